"""How one forward runs on this host: host facts, the plan chosen once at load, transformers' reference forward, mdcli's own forward, attention cores and weight formats."""
