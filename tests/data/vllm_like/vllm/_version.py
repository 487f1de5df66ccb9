__version__ = version = '0.19.1'
__version_tuple__ = version_tuple = (0, 19, 1)
__commit_id__ = commit_id = None
