"""rapydli.cluster"""
