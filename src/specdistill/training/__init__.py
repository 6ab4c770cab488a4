"""Distillation of drafts: losses, metrics, Lightning modules."""
