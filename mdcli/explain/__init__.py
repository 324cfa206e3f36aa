"""Pictures of a forest: its layout and mask (mdcli explain) and a speculative step."""
