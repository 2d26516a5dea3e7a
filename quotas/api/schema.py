"""OpenAPI postprocessing: say in the schema what the server enforces."""


def strict_request_bodies(result, generator, request, public):
    """Request bodies reject fields they do not know (StrictSerializer): additionalProperties false."""
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
    return result
