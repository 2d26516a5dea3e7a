"""The spend dashboard at /dashboard/: Django templates over the rollups and the engine's budgets."""
