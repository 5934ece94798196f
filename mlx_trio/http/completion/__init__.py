"""What every wire API shares to serve a completion: tools, tool choice, the output router."""
