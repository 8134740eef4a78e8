"""What a run keeps on disk: checkpoints and their checks, what a resume continues (and the branch folders it sets aside), the run folder with its lock and its log."""
