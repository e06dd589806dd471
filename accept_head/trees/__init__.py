"""Draft trees: tree masks and lossless verification, drafters that feed a whole depth at once, which branches
grow (head, EAGLE-2, EAGLE-1, C2T), the tree round and labels for every drafted node."""
