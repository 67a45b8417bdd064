"""Starting processes: the one process supervisor, and the one-box launcher behind `psgrad launch`."""
