"""rapydli.autotune"""
