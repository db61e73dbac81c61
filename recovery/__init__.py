"""trainguard.recovery"""
