"""The apps of a world (tools), their MCP gateway, and world state snapshot/reset."""
