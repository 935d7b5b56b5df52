"""The child side of render_backend=auto's measurement: one short-lived process per backend, run by file path
(`python render_probe.py ...`, no wamkit import) with MUJOCO_GL / PYOPENGL_PLATFORM / MUJOCO_EGL_DEVICE_ID already in
its environment, so a GL stack that crashes takes only this process down.

    render_probe.py frames SIZE N   -> one JSON line: startup_s (import mujoco + context + first frame), ms_per_frame
                                       (mean of N more frames), renderer (GL_RENDERER), mean_pixel
    render_probe.py egl-devices     -> one JSON line: the EGL devices in eglQueryDevicesEXT order (the order
                                       MUJOCO_EGL_DEVICE_ID indexes), each with its CUDA ordinal when the driver
                                       reports one (EGL_CUDA_DEVICE_NV), its DRM file and whether it is software
"""

import json
import os
import sys
import time

# A small scene shaped like the simulators' (a floor, a dozen lit objects, one shadow-casting light), at MuJoCo's
# default render quality (4x MSAA, 4096^2 shadow map: what render_quality=model uses).
SCENE = """<mujoco><visual><quality shadowsize="4096" offsamples="4"/><global offwidth="{s}" offheight="{s}"/></visual>
<worldbody><light castshadow="true" pos="0 0 3" dir="0 0 -1"/><light pos="1 1 2" dir="-1 -1 -2"/>
<geom type="plane" size="1 1 .1" rgba=".8 .8 .8 1"/>{objects}
<camera name="c" pos="0 -1.2 1" xyaxes="1 0 0 0 .64 .77"/></worldbody></mujoco>"""
OBJECT = '<body pos="{x:.2f} {y:.2f} .1"><geom type="{t}" size=".05 .04 .03" rgba="{r:.1f} .3 {b:.1f} 1"/></body>'


def _scene(size: int) -> str:
    objs = [OBJECT.format(x=-.5 + .25 * (i % 5), y=-.3 + .3 * (i // 5), t=("box", "sphere", "capsule")[i % 3],
                          r=.1 * (i % 10), b=1 - .1 * (i % 10)) for i in range(12)]
    return SCENE.format(s=size, objects="".join(objs))


def frames(size: int, n: int) -> dict:
    t0 = time.perf_counter()
    import mujoco

    m = mujoco.MjModel.from_xml_string(_scene(size))
    d = mujoco.MjData(m)
    mujoco.mj_forward(m, d)
    r = mujoco.Renderer(m, size, size)
    r.update_scene(d, camera="c")
    img = r.render()
    startup = time.perf_counter() - t0
    renderer = ""
    try:
        from OpenGL import GL

        r._gl_context.make_current()
        renderer = GL.glGetString(GL.GL_RENDERER).decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - the name is a nicety
        renderer = f"? ({type(e).__name__})"
    t1 = time.perf_counter()
    for _ in range(n):
        r.update_scene(d, camera="c")
        img = r.render()
    per = (time.perf_counter() - t1) / max(n, 1)
    out = {"startup_s": round(startup, 4), "ms_per_frame": round(per * 1e3, 3), "frames": n, "size": size,
           "renderer": renderer, "mean_pixel": round(float(img.mean()), 3),
           "context": type(r._gl_context).__module__}
    r.close()
    return out


def egl_devices() -> dict:
    import ctypes

    from mujoco.egl import egl_ext as EGL

    query_attrib = query_string = None
    try:
        query_attrib = ctypes.CFUNCTYPE(EGL.EGLBoolean, EGL.EGLDeviceEXT, EGL.EGLint, ctypes.POINTER(ctypes.c_long))(
            EGL.eglGetProcAddress("eglQueryDeviceAttribEXT"))
        query_string = ctypes.CFUNCTYPE(ctypes.c_char_p, EGL.EGLDeviceEXT, EGL.EGLint)(
            EGL.eglGetProcAddress("eglQueryDeviceStringEXT"))
    except TypeError:
        pass
    out = []
    for i, dev in enumerate(EGL.eglQueryDevicesEXT(max_devices=32)):
        cuda = drm = None
        ext = ""
        if query_attrib is not None:
            v = ctypes.c_long(-1)
            if query_attrib(dev, 0x323A, ctypes.byref(v)) == 1 and v.value >= 0:   # EGL_CUDA_DEVICE_NV
                cuda = int(v.value)
        if query_string is not None:
            ext = (query_string(dev, 0x3055) or b"").decode(errors="replace")      # EGL_EXTENSIONS
            if "EGL_EXT_device_drm" in ext:
                drm = (query_string(dev, 0x3233) or b"").decode(errors="replace") or None  # EGL_DRM_DEVICE_FILE_EXT
        out.append({"index": i, "cuda": cuda, "drm": drm, "software": "EGL_MESA_device_software" in ext})
    return {"devices": out}


if __name__ == "__main__":
    what = sys.argv[1]
    res = frames(int(sys.argv[2]), int(sys.argv[3])) if what == "frames" else egl_devices()
    res.update(mujoco_gl=os.environ.get("MUJOCO_GL"), egl_device=os.environ.get("MUJOCO_EGL_DEVICE_ID"))
    sys.stdout.write("WAMKIT_PROBE " + json.dumps(res) + "\n")
    sys.stdout.flush()
