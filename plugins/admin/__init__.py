"""Admin websocket and routes: tree snapshots, KV and request events, stats, policies."""

from plugins.admin.ws import add_admin_routes

__all__ = ["add_admin_routes"]
