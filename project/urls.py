from django.contrib import admin
from django.http import HttpResponseRedirect
from django.urls import include, path

admin.site.site_header = "agent-quotas"
admin.site.site_title = "agent-quotas"
admin.site.index_title = "Quota hierarchy and policy"

urlpatterns = [
    path("", lambda request: HttpResponseRedirect("/admin/")),
    path("admin/", admin.site.urls),
    path("api/", include("quotas.api.urls")),
    path("dashboard/", include("quotas.dashboard.urls")),
]
