"""Generated code for pdserve's internal services (package pdserve.internal.v1)."""
