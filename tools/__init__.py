"""What the CLI offers beside serving, off the request path: they may use the core, the core never imports them."""
