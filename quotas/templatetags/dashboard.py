"""{% load dashboard %}: the dashboard's number formats as template filters."""

from django import template

from quotas.dashboard import formatting

register = template.Library()

register.filter("usd", formatting.usd)
register.filter("count", formatting.count)
register.filter("amount", formatting.amount)
