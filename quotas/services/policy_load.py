"""Apply a policy document: create or update, in one transaction.

Nothing is deleted unless ``prune=True``; what the database has and the file
does not is listed in the report instead, so an operator sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.apps import apps
from django.db import DataError, IntegrityError, models, transaction
from django.db.models import ProtectedError

from quotas.models import Agent, Limit, Member, ModelPrice, Organization, Override, Team, Tier, ToolCost
from quotas.policy.document import UNSET, NodeDoc, PolicyDoc, PolicyFileError
from quotas.vocabulary import Level

SPEC_VALUES = ("amount", "burst", "shadow")


@dataclass
class LoadReport:
    created: int = 0
    updated: int = 0
    unchanged: int = 0
    deleted: int = 0
    not_in_file: list[str] = field(default_factory=list)
    also_deleted: dict[str, int] = field(default_factory=dict)  # what the deletions cascaded to, e.g. API keys

    def summary(self) -> str:
        return f"{self.created} created, {self.updated} updated, {self.unchanged} unchanged, {self.deleted} deleted"


class _Loader:
    def __init__(self, prune: bool):
        self.prune = prune
        self.report = LoadReport()
        self.seen: dict[type[models.Model], set[int]] = {model: set() for model in _PRUNE_ORDER}

    def upsert(self, model: type[models.Model], lookup: dict, values: dict) -> models.Model:
        row = model.objects.filter(**lookup).first()
        if row is None:
            row = model(**lookup, **values)
            row.save()
            self.report.created += 1
        else:
            changed = [name for name, value in values.items() if getattr(row, name) != value]
            if changed:
                for name in changed:
                    setattr(row, name, values[name])
                row.save()
                self.report.updated += 1
            else:
                self.report.unchanged += 1
        self.seen[model].add(row.pk)
        return row

    def limits(self, owner: dict, doc_limits, model: type[models.Model], extra_values=()) -> None:
        for spec in doc_limits:
            lookup = dict(owner, metric=spec.metric, window=spec.window, period=spec.period, tool=spec.tool,
                          model=spec.model)
            values = {name: getattr(spec, name) for name in (*SPEC_VALUES, *extra_values)}
            values["alert_at"] = None if spec.alert_at is None else list(spec.alert_at)  # the column holds a list
            self.upsert(model, lookup, values)

    def node(self, doc: NodeDoc, *, org: Organization | None = None, parent: models.Model | None = None):
        model, owner, parent_field = _NODE_MODELS[doc.level]
        values = {}
        if parent_field and parent_field != "org":
            # Looked up by (org, id): a node the file puts under another team or user moves there.
            values[parent_field] = parent
        if doc.name is not UNSET:
            values["name"] = doc.name
        if doc.tier is not UNSET:
            values["tier"] = Tier.objects.get(slug=doc.tier) if doc.tier else None
        lookup = {"slug": doc.slug} if org is None else {"org": org, "slug": doc.slug}
        row = self.upsert(model, lookup, values)
        self.limits({owner: row}, doc.limits, Limit)
        self.limits({owner: row}, doc.overrides, Override, ("expires_at", "reason"))
        for child in doc.children:
            self.node(child, org=org or row, parent=row)

    def finish(self) -> None:
        for model in _PRUNE_ORDER:
            stale = model.objects.exclude(pk__in=self.seen[model])
            if not stale.exists():
                continue
            if self.prune:
                try:
                    _, per_model = stale.delete()
                except ProtectedError as exc:
                    raise PolicyFileError([("", f"cannot prune: {exc.args[0]}")]) from None
                self.report.deleted += per_model.pop(model._meta.label, 0)
                for label, count in per_model.items():
                    if label not in {m._meta.label for m in _PRUNE_ORDER}:
                        name = apps.get_model(label)._meta.verbose_name_plural
                        self.report.also_deleted[name] = self.report.also_deleted.get(name, 0) + count
            else:
                self.report.not_in_file.extend(f"{model._meta.verbose_name}: {_label(row)}" for row in stale)


def _label(row) -> str:
    if isinstance(row, (Limit, Override)):
        owner = next(getattr(row, name) for name in ("tier", "org", "team", "member", "agent")
                     if getattr(row, f"{name}_id", None))
        return f"{owner} {row.describe()}"
    return str(row)


# level -> (model, owner field on Limit/Override, parent field name on the child model)
_NODE_MODELS = {
    Level.ORG: (Organization, "org", None),
    Level.TEAM: (Team, "team", "org"),
    Level.USER: (Member, "member", "team"),
    Level.AGENT: (Agent, "agent", "member"),
}
# Children before parents, limits before what owns them, so nothing is protected or cascaded twice.
_PRUNE_ORDER = (Override, Limit, Agent, Member, Team, Organization, Tier, ToolCost, ModelPrice)


def policy_load(*, doc: PolicyDoc, prune: bool = False) -> LoadReport:
    """Create or update everything ``doc`` describes, in one transaction."""
    loader = _Loader(prune)
    try:
        with transaction.atomic():
            for tool, weight in doc.tool_costs.items():
                loader.upsert(ToolCost, {"tool": tool}, {"weight": weight})
            for model_name, (price_in, price_out) in doc.model_prices.items():
                loader.upsert(ModelPrice, {"model": model_name}, {"input_per_1k": price_in, "output_per_1k": price_out})
            for tier_doc in doc.tiers:
                values = {name: getattr(tier_doc, name) for name in ("level", "description")
                          if getattr(tier_doc, name) is not UNSET}
                tier = loader.upsert(Tier, {"slug": tier_doc.slug}, values)
                loader.limits({"tier": tier}, tier_doc.limits, Limit)
            for org_doc in doc.orgs:
                loader.node(org_doc)
            loader.finish()
    except (IntegrityError, DataError) as exc:
        # The parser checks what the constraints and columns check; this is the net under it.
        raise PolicyFileError([("", f"the database refused the policy: {exc}")]) from None
    return loader.report
