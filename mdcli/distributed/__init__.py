"""Beyond one process: --each's documents answered by Ray actors (the optional `ray` extra).

Nothing here schedules across hosts by hand: Ray places the actors, each of which loads the model
once and answers the chunks of documents the driver hands it as it frees up. Imported only by the
command line when --workers or --ray-address is given, so Ray loads with nothing else.
"""
