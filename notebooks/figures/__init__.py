"""Each notebook's figures, beside the notebooks: notebook N imports
`from notebooks.figures import stageN as figures` and draws with `figures.<name>(...)`.

    stage1.py ... stage12.py  the figures of one notebook; a figure drawn again by a later
                              notebook is defined where it first appears and re-exported there
    layouts.py                CuTe layouts evaluated in plain Python (wgmma fragments, swizzle)
    timelines.py              the TMA -> MMA ring model and its timeline figure

The palette and drawing helpers are shared with the tools' figures: common/tools/draw.py.
"""
