"""Optional integrations. Each subpackage is imported only by the framework it serves."""
