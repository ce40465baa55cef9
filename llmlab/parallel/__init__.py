"""Parallel training written from scratch on torch.distributed: pipeline (`pipeline`), and more to come."""
