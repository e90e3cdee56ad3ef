"""rapydli.server"""
