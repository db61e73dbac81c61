"""trainguard.agent"""
