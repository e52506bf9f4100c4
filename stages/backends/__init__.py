"""Inference backends behind one interface (base.InferenceBackend)."""
