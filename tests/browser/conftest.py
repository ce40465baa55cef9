"""tests/browser/ holds what tests/test_browser.py opens in JupyterLab; its notebooks are not tests themselves.

nbval would otherwise collect tests/browser/*.ipynb (tests/ is a testpath), and run the fixture a second time.
"""

collect_ignore_glob = ["*.ipynb"]
