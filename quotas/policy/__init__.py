"""The policy model in plain Python: validation rules and the policy file format."""
