"""kvd_client: the kvd block manager's API over the daemon (see kvd_client.client)."""

from kvd_client.client import AsyncClient, Client, check_endpoint, default_endpoint

__all__ = ["Client", "AsyncClient", "check_endpoint", "default_endpoint"]
