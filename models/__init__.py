"""Model adapters, one per architecture family, registered by model_type."""
