"""What every wire API shares to serve a completion: the parsed call, the one path, the renderer seam, tools, the output router."""
