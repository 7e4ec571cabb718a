"""Storage-tier backends that need a server (registry kind `storage`): `redis`."""
