"""kvd_client: the kvd block manager's API over the daemon (see kvd_client.client)."""

from kvd_client.client import AsyncClient, Client, PendingStep, check_endpoint, default_endpoint

__all__ = ["Client", "AsyncClient", "PendingStep", "check_endpoint", "default_endpoint"]
