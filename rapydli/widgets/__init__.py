"""rapydli.widgets"""
