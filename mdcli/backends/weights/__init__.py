"""Weight formats, each a copy of the model's weights laid out for one kernel and multiplied through one call shape."""
