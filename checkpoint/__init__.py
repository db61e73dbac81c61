"""trainguard.checkpoint"""
