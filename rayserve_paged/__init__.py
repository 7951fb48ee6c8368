"""rayserve-paged."""
