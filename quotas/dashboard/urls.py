from django.contrib.auth import views as auth_views
from django.urls import path, reverse_lazy

from . import views

app_name = "dashboard"

urlpatterns = [
    path("", views.index, name="index"),
    path("spend.csv", views.spend_csv, name="spend_csv"),
    path("login/", auth_views.LoginView.as_view(template_name="dashboard/login.html",
                                                next_page=reverse_lazy("dashboard:index")), name="login"),
    path("logout/", auth_views.LogoutView.as_view(next_page=reverse_lazy("dashboard:login")), name="logout"),
]
