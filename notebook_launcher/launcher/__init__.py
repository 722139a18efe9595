"""Starting a function on N local ranks and bringing back its output, results and failures."""
