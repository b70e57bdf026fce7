"""Lightning callbacks that work for every model family."""
