from django.urls import path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from quotas.api import views

urlpatterns = [
    path("v1/check", views.CheckView.as_view(), name="api-check"),
    path("v1/check/batch", views.CheckBatchView.as_view(), name="api-check-batch"),
    path("v1/usage", views.UsageView.as_view(), name="api-usage"),
    path("v1/leases", views.LeaseCreateView.as_view(), name="api-leases"),
    path("v1/leases/<str:lease>", views.LeaseDetailView.as_view(), name="api-lease"),
    path("v1/leases/<str:lease>/renew", views.LeaseRenewView.as_view(), name="api-lease-renew"),
    path("v1/agents/<str:agent>/quota", views.AgentQuotaView.as_view(), name="api-agent-quota"),
    path("v1/reports/daily-spend", views.DailySpendView.as_view(), name="api-daily-spend"),
    path("ping", views.PingView.as_view(), name="api-ping"),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    re_path(r"^.*$", views.api_not_found),
]
