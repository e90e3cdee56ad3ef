"""rapydli.experiments"""
