"""Where the template relies on Lightning's (or torch's) private behaviour, each place with its version and canary."""
