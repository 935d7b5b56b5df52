"""Which OpenGL MuJoCo got (MUJOCO_GL) and what one 224x224 frame costs: a lit plane and sphere with a shadow.

    python bench/device/gl_check.py
"""

import os
import time

import mujoco

XML = """<mujoco><visual><quality shadowsize="4096" offsamples="4"/></visual><worldbody>
<light castshadow="true" pos="0 0 3" dir="0 0 -1"/><geom type="plane" size="1 1 .1" rgba=".8 .8 .8 1"/>
<geom type="sphere" size=".1" pos="0 0 .2" rgba=".9 .2 .2 1"/><camera name="c" pos="0 -1 1" xyaxes="1 0 0 0 .7 .7"/>
</worldbody></mujoco>"""

m = mujoco.MjModel.from_xml_string(XML)
d = mujoco.MjData(m)
mujoco.mj_forward(m, d)
for label, samples, shadow in (("4x MSAA, 4096 shadow", 4, 4096), ("no MSAA, 1024 shadow", 0, 1024)):
    m.vis.quality.offsamples, m.vis.quality.shadowsize = samples, shadow
    r = mujoco.Renderer(m, 224, 224)
    r.update_scene(d, camera="c")
    img = r.render()
    t0 = time.perf_counter()
    for _ in range(20):
        r.update_scene(d, camera="c")
        img = r.render()
    print(f"gl_check MUJOCO_GL={os.environ.get('MUJOCO_GL')}: {label}: {(time.perf_counter() - t0) / 20 * 1e3:.1f} ms "
          f"per frame, mean pixel {img.mean():.1f}", flush=True)
    r.close()
