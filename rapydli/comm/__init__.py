"""rapydli.comm"""
