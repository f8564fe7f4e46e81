"""Environments and the supervised env-server actors that run them."""
