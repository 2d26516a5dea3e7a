"""The operator's admin: org -> teams -> users -> agents, limits edited inline."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.postgres.forms import SimpleArrayField
from django.core.exceptions import ValidationError
from django.db.models import Count, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.html import format_html

from quotas.models import (
    Agent, ApiKey, BudgetAlert, Limit, Member, ModelPrice, Organization, Override, Team, Tier, ToolCost,
)
from quotas.models.limits import SPEC_FIELDS
from quotas.policy.rules import DEFAULT_ALERT_THRESHOLDS
from quotas.selectors import agent_effective_limits
from quotas.services.api_keys import api_key_create, api_key_revoke



def changelist_link(model, label: str, count: int, **filters) -> str:
    url = reverse(f"admin:quotas_{model._meta.model_name}_changelist")
    query = "&".join(f"{key}={value}" for key, value in filters.items())
    return format_html('<a href="{}?{}">{} {}</a>', url, query, count, label)


class AlertAtField(SimpleArrayField):
    """Budget alert thresholds typed as '50, 80, 100'. Empty: the default for the metric
    (the column's null); 'none': no alerts (an empty list). A plain SimpleArrayField reads an
    empty box as an empty list, which would turn alerts off where the operator left it blank."""

    NONE = "none"

    def __init__(self, **kwargs):
        defaults = ", ".join(map(str, DEFAULT_ALERT_THRESHOLDS))
        kwargs.setdefault("required", False)
        kwargs.setdefault("label", "alert at (%)")
        kwargs.setdefault("help_text", f"Budget alert thresholds in percent, e.g. {defaults}. Empty: {defaults} for "
                                       f"cost and token budgets, none for other metrics; '{self.NONE}': no alerts.")
        super().__init__(forms.IntegerField(), **kwargs)

    def prepare_value(self, value):
        if isinstance(value, list) and not value:
            return self.NONE
        return super().prepare_value(value)

    def to_python(self, value):
        if isinstance(value, str) and value.strip().lower() == self.NONE:
            return []
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return super().to_python(value)

    def clean(self, value):
        value = forms.Field.clean(self, value)  # to_python, validate, run_validators (below)
        return None if value is None else [self.base_field.clean(item) for item in value]

    def validate(self, value):
        if value is not None:  # the range and repeats are the model's rules (LimitSpec.clean)
            super().validate(value)

    def run_validators(self, value):
        if value is not None:
            super().run_validators(value)

    def has_changed(self, initial, data):
        try:
            value = self.to_python(data)
        except ValidationError:
            return True
        if isinstance(initial, str):
            initial = self.to_python(initial)
        return value != initial


class SpecForm(forms.ModelForm):
    alert_at = AlertAtField()


SPEC_FORM_FIELDS = (*SPEC_FIELDS, "alert_at")


class LimitInline(admin.TabularInline):
    model = Limit
    form = SpecForm
    fields = SPEC_FORM_FIELDS
    extra = 0
    verbose_name_plural = "limits (a node's own limit replaces its tier's limit of the same metric, window, tool and model)"


class OverrideInline(admin.TabularInline):
    model = Override
    form = SpecForm
    fields = (*SPEC_FORM_FIELDS, "expires_at", "reason")
    extra = 0
    verbose_name_plural = "overrides (replace a limit of the same key until they expire)"


class NodeAdmin(admin.ModelAdmin):
    inlines = [LimitInline, OverrideInline]
    search_fields = ["slug", "name"]
    list_filter = ["tier"]
    readonly_fields = ["created_at", "updated_at"]
    autocomplete_fields = ["tier"]


class TeamInline(admin.TabularInline):
    model = Team
    fields = ("slug", "name", "tier")
    extra = 0
    show_change_link = True


class MemberInline(admin.TabularInline):
    model = Member
    fields = ("slug", "name", "tier")
    extra = 0
    show_change_link = True


class AgentInline(admin.TabularInline):
    model = Agent
    fields = ("slug", "name", "tier")
    extra = 0
    show_change_link = True


@admin.register(Organization)
class OrganizationAdmin(NodeAdmin):
    list_display = ["slug", "name", "tier", "teams_link", "members_link", "agents_link", "alerts_link"]
    inlines = [LimitInline, OverrideInline, TeamInline]
    filter_horizontal = ["viewers"]
    fieldsets = [
        (None, {"fields": ["slug", "name", "tier"]}),
        ("Budget alerts and dashboard", {"fields": ["alert_webhook_url", "viewers"]}),
        (None, {"fields": ["created_at", "updated_at"]}),
    ]

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("tier").annotate(
            team_count=Count("teams", distinct=True),
            member_count=Count("members", distinct=True),
            agent_count=Count("agents", distinct=True),
            alert_count=Coalesce(Subquery(
                BudgetAlert.objects.filter(org=OuterRef("slug")).order_by().values("org")
                .annotate(count=Count("pk")).values("count")
            ), 0),
        )

    def formfield_for_dbfield(self, db_field, request, **kwargs):
        if db_field.name == "alert_webhook_url":
            kwargs["assume_scheme"] = "https"
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    @admin.display(description="teams", ordering="team_count")
    def teams_link(self, org):
        return changelist_link(Team, "teams", org.team_count, org__id__exact=org.id)

    @admin.display(description="users", ordering="member_count")
    def members_link(self, org):
        return changelist_link(Member, "users", org.member_count, org__id__exact=org.id)

    @admin.display(description="agents", ordering="agent_count")
    def agents_link(self, org):
        return changelist_link(Agent, "agents", org.agent_count, org__id__exact=org.id)

    @admin.display(description="budget alerts", ordering="alert_count")
    def alerts_link(self, org):
        return changelist_link(BudgetAlert, "alerts", org.alert_count, org=org.slug)


@admin.register(Team)
class TeamAdmin(NodeAdmin):
    list_display = ["slug", "name", "org", "tier", "members_link"]
    list_filter = ["org", "tier"]
    list_select_related = ["org", "tier"]
    search_fields = ["slug", "name", "org__slug"]
    autocomplete_fields = ["org", "tier"]
    inlines = [LimitInline, OverrideInline, MemberInline]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(member_count=Count("members"))

    @admin.display(description="users", ordering="member_count")
    def members_link(self, team):
        return changelist_link(Member, "users", team.member_count, team__id__exact=team.id)


@admin.register(Member)
class MemberAdmin(NodeAdmin):
    list_display = ["slug", "name", "team", "org", "tier", "agents_link"]
    list_filter = ["org", "team", "tier"]
    list_select_related = ["org", "team__org", "tier"]
    search_fields = ["slug", "name", "team__slug", "org__slug"]
    autocomplete_fields = ["team", "tier"]
    readonly_fields = ["org", "created_at", "updated_at"]
    inlines = [LimitInline, OverrideInline, AgentInline]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(agent_count=Count("agents"))

    @admin.display(description="agents", ordering="agent_count")
    def agents_link(self, member):
        return changelist_link(Agent, "agents", member.agent_count, member__id__exact=member.id)


@admin.register(Agent)
class AgentAdmin(NodeAdmin):
    list_display = ["slug", "name", "member", "team", "org", "tier"]
    list_filter = ["org", "member__team", "tier"]
    list_select_related = ["org", "member__team__org", "member__org", "tier"]
    search_fields = ["slug", "name", "member__slug", "member__team__slug", "org__slug"]
    autocomplete_fields = ["member", "tier"]
    readonly_fields = ["org", "effective_limits", "created_at", "updated_at"]
    fieldsets = [
        (None, {"fields": ["slug", "name", "member", "org", "tier"]}),
        ("Effective limits", {"fields": ["effective_limits"]}),
        (None, {"fields": ["created_at", "updated_at"]}),
    ]

    @admin.display(description="team", ordering="member__team__slug")
    def team(self, agent):
        return agent.member.team

    @admin.display(description="every limit that applies")
    def effective_limits(self, agent):
        if agent.pk is None:
            return "Shown once the agent is saved."
        return render_to_string("admin/quotas/effective_limits.html", {"limits": agent_effective_limits(agent=agent)})


@admin.register(Tier)
class TierAdmin(admin.ModelAdmin):
    list_display = ["slug", "level", "description", "limit_count"]
    list_filter = ["level"]
    search_fields = ["slug", "description"]
    inlines = [LimitInline]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(limit_count=Count("limits"))

    @admin.display(description="limits", ordering="limit_count")
    def limit_count(self, tier):
        return tier.limit_count


class SpecAdmin(admin.ModelAdmin):
    """Every limit or override in one searchable list (each is edited on its owner's page)."""

    list_filter = ["metric", "period", "shadow"]
    search_fields = ["tool", "model", "org__slug", "team__slug", "member__slug", "agent__slug"]
    list_select_related = ["org", "team__org", "member__org", "agent__org"]

    @admin.display(description="owner")
    def owner(self, spec):
        for name in ("tier", "org", "team", "member", "agent"):
            if getattr(spec, f"{name}_id", None):
                return f"{spec._meta.get_field(name).verbose_name} {getattr(spec, name)}"
        return "-"


@admin.register(Limit)
class LimitAdmin(SpecAdmin):
    list_display = ["__str__", "owner", "metric", "amount", "span", "tool", "model", "shadow"]
    search_fields = [*SpecAdmin.search_fields, "tier__slug"]
    list_select_related = [*SpecAdmin.list_select_related, "tier"]
    fields = ["tier", "org", "team", "member", "agent", *SPEC_FORM_FIELDS]
    form = SpecForm
    autocomplete_fields = ["tier", "org", "team", "member", "agent"]


@admin.register(Override)
class OverrideAdmin(SpecAdmin):
    list_display = ["__str__", "owner", "expires_at", "reason", "created_at"]
    list_filter = [*SpecAdmin.list_filter, "expires_at"]
    search_fields = [*SpecAdmin.search_fields, "reason"]
    fields = ["org", "team", "member", "agent", *SPEC_FORM_FIELDS, "expires_at", "reason"]
    form = SpecForm
    autocomplete_fields = ["org", "team", "member", "agent"]


@admin.register(ToolCost)
class ToolCostAdmin(admin.ModelAdmin):
    list_display = ["tool", "weight"]
    list_editable = ["weight"]
    list_filter = ["weight"]
    search_fields = ["tool"]


class FreeModelFilter(admin.SimpleListFilter):
    title = "price"
    parameter_name = "price"

    def lookups(self, request, model_admin):
        return [("free", "free"), ("paid", "paid")]

    def queryset(self, request, queryset):
        free = Q(input_per_1k=0, output_per_1k=0)
        if self.value() == "free":
            return queryset.filter(free)
        if self.value() == "paid":
            return queryset.exclude(free)
        return queryset


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    list_display = ["model", "input_per_1k", "output_per_1k"]
    list_editable = ["input_per_1k", "output_per_1k"]
    list_filter = [FreeModelFilter]
    search_fields = ["model"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix_shown", "name", "org", "created_at", "revoked_at"]
    list_filter = ["org", ("revoked_at", admin.EmptyFieldListFilter)]
    list_select_related = ["org"]
    search_fields = ["prefix", "name", "org__slug"]
    actions = ["revoke"]

    def get_fields(self, request, obj=None):
        return ["org", "name"] if obj is None else ["org", "name", "prefix_shown", "created_at", "revoked_at"]

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else ["org", "prefix_shown", "created_at", "revoked_at"]

    @admin.display(description="key")
    def prefix_shown(self, key):
        return f"{key.prefix}…"

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        key, raw = api_key_create(org=obj.org, name=obj.name)
        obj.pk = key.pk
        obj.refresh_from_db()
        self.message_user(
            request,
            format_html(
                "The new key for {} is <code style='user-select: all'>{}</code>. "
                "Copy it now: only its hash is stored, it cannot be shown again.",
                key.org.slug, raw,
            ),
            messages.WARNING,
        )

    @admin.action(description="Revoke selected keys (they stop working within a second)")
    def revoke(self, request, queryset):
        for key in queryset:
            api_key_revoke(key=key)
        self.message_user(request, f"Revoked {queryset.count()} key(s).", messages.SUCCESS)


@admin.register(BudgetAlert)
class BudgetAlertAdmin(admin.ModelAdmin):
    """What was sent: read-only (alerts are written by the evaluation and its deliveries)."""

    list_display = ["created_at", "org", "node_shown", "limit_description", "threshold_shown", "use",
                    "period_start", "status", "attempts", "sent_at", "last_error_short"]
    list_filter = ["status", "org", "threshold", "level"]
    search_fields = ["org", "node", "limit_description", "last_error"]
    date_hierarchy = "created_at"
    fields = ["org", "level", "node", "limit_description", "limit_ref", "threshold", "used", "amount", "period_start",
              "created_at", "status", "webhook_url", "attempts", "sent_at", "last_error"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.display(description="node", ordering="node")
    def node_shown(self, alert):
        return f"{alert.level} {alert.node}"

    @admin.display(description="threshold", ordering="threshold")
    def threshold_shown(self, alert):
        return f"{alert.threshold}%"

    @admin.display(description="used / amount")
    def use(self, alert):
        return f"{alert.used.normalize():f} / {alert.amount.normalize():f}"

    @admin.display(description="last error")
    def last_error_short(self, alert):
        return alert.last_error[:80] + ("…" if len(alert.last_error) > 80 else "")
