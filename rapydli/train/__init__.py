"""rapydli.train"""
