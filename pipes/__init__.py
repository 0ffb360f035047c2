"""neatpack.pipes: the nodes and the pure functions behind them."""
