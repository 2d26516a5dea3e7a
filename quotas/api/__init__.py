"""The check API (v1): DRF views over the engine. See the README's "Check API" section."""
