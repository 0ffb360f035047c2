"""neatpack.graphs: prebuilt graphs and the checkpointable loader."""
