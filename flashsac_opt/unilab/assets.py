"""Placeholder G1 meshes, so UniLab's G1 tasks run where its model hub cannot be reached.

UniLab 1.5.2 ships the G1 model XMLs without their STL meshes and downloads them (with
``textures/floor.png``, its marker that the G1 assets are complete) from a model hub at first
use; offline that fails on ``pelvis.STL``. If every geom that uses one of those meshes is
visual only (no collision, no mass, no contact pair, no ray sensor), the meshes do not enter
the physics, and tiny placeholder meshes with the same file names give the same simulation.

:func:`placeholder_meshes` checks exactly that before writing anything: it copies the G1
XMLs to two temporary directories, compiles every model that uses the meshes with MuJoCo (so
default classes and includes are resolved the way MuJoCo resolves them) once with tiny and
once with large placeholders, and refuses when a mesh geom can collide, carries mass, or the
two compiled models differ in any inertial quantity or in a short simulation. Then it creates
only the missing files: existing meshes (real ones) are never overwritten.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from flashsac_opt.unilab.patch import locate_unilab

G1_DIR = Path("unilab/assets/robots/g1")  # relative to the directory holding the unilab package
MESH_DIR = "assets"  # UniLab's hub directory for the G1 meshes (relative to G1_DIR)
MARKER = Path("textures/floor.png")  # UniLab's "G1 assets complete" marker (no XML uses it)
SIM_STEPS = 50


class AssetError(RuntimeError):
    """A refusal: the message says why; nothing was written."""


class AssetWriteError(AssetError):
    """Writing a file failed; the files already created were removed again."""


@dataclass
class PlaceholderReport:
    g1_dir: Path
    models: list[str]  # XML files checked, relative to g1_dir
    mesh_geoms: int  # geoms using one of the placeholder meshes, over all models checked
    created: list[Path] = field(default_factory=list)  # new files (would be created on a dry run)
    kept: list[Path] = field(default_factory=list)  # existing meshes that are not placeholders: untouched
    already: list[Path] = field(default_factory=list)  # placeholders written earlier: untouched
    dry_run: bool = False

    @property
    def scene(self) -> Path:
        """The G1 flat scene, for UniLab's ``env.scene.model_file``."""
        return self.g1_dir / "scene_flat.xml"


def tetrahedron_stl(size: float = 0.001) -> bytes:
    """A binary STL tetrahedron (MuJoCo needs at least 4 vertices per mesh)."""
    v = [(0, 0, 0), (size, 0, 0), (0, size, 0), (0, 0, size)]
    faces = [(0, 2, 1), (0, 1, 3), (0, 3, 2), (1, 2, 3)]
    out = b"\0" * 80 + struct.pack("<I", len(faces))
    for face in faces:
        out += struct.pack("<3f", 0, 0, 0) + b"".join(struct.pack("<3f", *v[i]) for i in face) + struct.pack("<H", 0)
    return out


def grey_png(width: int = 4, height: int = 4) -> bytes:
    raw = b"".join(b"\x00" + b"\x80\x80\x80" * width for _ in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


PLACEHOLDER = tetrahedron_stl()


def _mujoco():
    try:
        import mujoco
    except ImportError as exc:
        raise AssetError(
            "placeholder-meshes needs mujoco to check that the meshes are visual only "
            "(pip install 'unilab[mujoco]==1.5.2'); nothing written"
        ) from exc
    return mujoco


def _geom_label(model, mujoco, geom: int) -> str:
    name = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_GEOM, geom)
    body = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_BODY, int(model.geom_bodyid[geom]))
    mesh = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_MESH, int(model.geom_dataid[geom]))
    return f"geom {name or '#' + str(geom)} (mesh {mesh}, body {body})"


def _stand_in(path: Path, source: Path | None) -> None:
    """A mesh that is not a placeholder target, only so the temporary copy compiles: the real
    file if there is one, else a dummy tetrahedron in the format its extension names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if source is not None and source.is_file():
        shutil.copyfile(source, path)
    elif path.suffix.lower() == ".obj":
        path.write_text("v 0 0 0\nv 0.001 0 0\nv 0 0.001 0\nv 0 0 0.001\nf 1 3 2\nf 1 2 4\nf 1 4 3\nf 2 3 4\n")
    else:
        path.write_bytes(tetrahedron_stl())


def _check_model(mujoco, rel: str, small_copy: Path, large_copy: Path, targets: set[str]) -> int:
    """Refuse unless the target meshes cannot affect this model's physics; returns the number of
    geoms using them. ``small_xml`` and ``large_xml`` are the same model in two copies whose
    target meshes are tiny and large tetrahedra (two directories: MuJoCo caches meshes by path)."""
    models = []
    small_xml = small_copy / rel
    for xml in (small_xml, large_copy / rel):
        try:
            models.append(mujoco.MjModel.from_xml_path(str(xml)))
        except ValueError as exc:  # MuJoCo's compile error
            raise AssetError(f"{rel}: MuJoCo cannot compile it to check its meshes ({exc}); nothing written") from exc
    small, large = models
    mesh_dir = (small_xml.parent / mujoco.MjSpec.from_file(str(small_xml)).meshdir).resolve()
    target_ids = set()
    for i in range(small.nmesh):
        file = small.paths[small.mesh_pathadr[i]:].split(b"\0", 1)[0].decode()
        if _rel(mesh_dir / file, small_copy) in targets:
            target_ids.add(i)
    mesh = [g for g in range(small.ngeom) if small.geom_type[g] == mujoco.mjtGeom.mjGEOM_MESH and small.geom_dataid[g] in target_ids]
    if mesh and small.mesh_vert.tobytes() == large.mesh_vert.tobytes():
        raise AssetError(f"{rel}: MuJoCo did not load the placeholder meshes where expected, so they cannot be checked; nothing written")
    reasons = []
    for g in mesh:
        if small.geom_contype[g] or small.geom_conaffinity[g]:
            reasons.append(f"{_geom_label(small, mujoco, g)} has contype={small.geom_contype[g]} "
                           f"conaffinity={small.geom_conaffinity[g]}: it can collide")
    in_pairs = set(small.pair_geom1.tolist()) | set(small.pair_geom2.tolist())
    for g in sorted(in_pairs & set(mesh)):
        reasons.append(f"{_geom_label(small, mujoco, g)} is in an explicit contact pair")
    if mesh and any(t == mujoco.mjtSensor.mjSENS_RANGEFINDER for t in small.sensor_type):
        reasons.append("the model has a rangefinder sensor, whose rays hit visual meshes too")
    inertial = ("body_mass", "body_inertia", "body_ipos", "body_iquat", "body_subtreemass")
    changed = [name for name in inertial if getattr(small, name).tobytes() != getattr(large, name).tobytes()]
    if changed:
        reasons.append(f"the mesh size changes {', '.join(changed)}: mesh geoms carry mass")
    if not reasons and _simulate(mujoco, small) != _simulate(mujoco, large):
        reasons.append(f"{SIM_STEPS} simulation steps differ between tiny and large placeholder meshes")
    if reasons:
        shown = reasons[:3] + ([f"and {len(reasons) - 3} more"] if len(reasons) > 3 else [])
        raise AssetError(
            f"{rel}: placeholder meshes would change the physics: {'; '.join(shown)}. "
            "Install the real meshes instead; nothing written"
        )
    return len(mesh)


def _simulate(mujoco, model) -> bytes:
    data = mujoco.MjData(model)
    if model.nkey:
        mujoco.mj_resetDataKeyframe(model, data, 0)
    for _ in range(SIM_STEPS):
        mujoco.mj_step(model, data)
    return data.qpos.tobytes() + data.qvel.tobytes() + data.sensordata.tobytes()


def _declared_meshes(mujoco, xml: Path, root: Path) -> set[Path] | None:
    """Where the mesh files an XML declares (with its includes) live; None if MuJoCo cannot
    parse it as a model (an include fragment). MuJoCo looks for a mesh in the model's meshdir,
    relative to the main file's directory; MjSpec reports a mesh declared in an included file
    with that file's directory in front, which is taken off here."""
    try:
        spec = mujoco.MjSpec.from_file(str(xml))
    except ValueError:
        return None
    found = set()
    for m in spec.meshes:
        name = Path(m.file)
        if name.is_absolute():
            for base in (xml.parent, root):
                if name.is_relative_to(base):
                    name = name.relative_to(base)
                    break
            else:
                raise AssetError(f"{xml.relative_to(root)}: cannot tell where its mesh {m.file} lives; nothing written")
        found.add((xml.parent / spec.meshdir / name).resolve())
    return found


def _rel(path: Path, copy: Path) -> str | None:
    """``path`` relative to the G1 mesh directory of ``copy`` (None outside it)."""
    path, root = path.resolve(), (copy / MESH_DIR).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else None


def _copy(g1_dir: Path, dest: Path, targets: set[str], size: float) -> Path:
    """A copy of the G1 directory at dest/g1 whose target meshes are tetrahedra of ``size``."""
    copy = dest / "g1"
    # the XMLs and whatever else they reference, but not the meshes (possibly large, real)
    shutil.copytree(g1_dir, copy, ignore=lambda d, names: names if Path(d) == g1_dir / MESH_DIR else [])
    (copy / MESH_DIR).mkdir(exist_ok=True)
    for name in targets:
        (copy / MESH_DIR / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / MESH_DIR / name).write_bytes(tetrahedron_stl(size))
    return copy


def check_visual_only(g1_dir: Path) -> tuple[list[str], list[str], int]:
    """(models checked, placeholder mesh names relative to the mesh directory, mesh geom count).

    The placeholders are the meshes that ``scene_flat.xml`` (UniLab's G1 scene, with the robot
    in ``g1.xml``) declares in the G1 mesh directory. Every XML under ``g1_dir`` that uses one
    of them is compiled in temporary copies; raises :class:`AssetError` if in any of them
    those meshes can affect the physics.
    """
    mujoco = _mujoco()
    if not (g1_dir / "scene_flat.xml").is_file():
        raise AssetError(f"{g1_dir}: no G1 scene (scene_flat.xml) here; nothing written")
    with tempfile.TemporaryDirectory(prefix="flashsac_opt_g1_") as tmp:
        small = _copy(g1_dir, Path(tmp) / "small", set(), 0.001)
        declared = _declared_meshes(mujoco, small / "scene_flat.xml", small)
        if declared is None:
            raise AssetError(f"{g1_dir / 'scene_flat.xml'}: MuJoCo cannot parse it; nothing written")
        targets = {r for r in (_rel(f, small) for f in declared) if r is not None}
        if not targets:
            raise AssetError(f"{g1_dir / 'scene_flat.xml'} declares no meshes in {MESH_DIR}/; nothing to do, nothing written")
        shutil.rmtree(small)
        small = _copy(g1_dir, Path(tmp) / "small", targets, 0.001)
        large = _copy(g1_dir, Path(tmp) / "large", targets, 0.5)
        models, geoms = [], 0
        for xml in sorted(small.rglob("*.xml")):
            rel = str(xml.relative_to(small))
            files = _declared_meshes(mujoco, xml, small)
            if files is None:
                if any(Path(name).name in xml.read_text() for name in targets):
                    raise AssetError(f"{rel}: names a G1 mesh but MuJoCo cannot parse it to check; nothing written")
                continue  # an include fragment without meshes (e.g. a sensor list)
            names = {_rel(f, small) for f in files}
            if not names & targets:
                continue
            for other in files:  # e.g. a scene's terrain meshes: needed to compile only
                name = _rel(other, small)
                if name in targets or not other.is_relative_to(small.resolve()):
                    continue
                source = g1_dir / MESH_DIR / name if name is not None else None
                for target in (other, large.resolve() / other.relative_to(small.resolve())):
                    if not target.exists():
                        _stand_in(target, source)
            geoms += _check_model(mujoco, rel, small, large, targets)
            models.append(rel)
    return models, sorted(targets), geoms


def placeholder_meshes(root: str | Path | None = None, dry_run: bool = False) -> PlaceholderReport:
    """Create the missing G1 meshes (placeholders) and the floor.png marker; see the module doc."""
    g1_dir = locate_unilab(root) / G1_DIR
    models, names, geoms = check_visual_only(g1_dir)
    report = PlaceholderReport(g1_dir, models, geoms, dry_run=dry_run)
    wanted = [(g1_dir / MESH_DIR / name, PLACEHOLDER) for name in names] + [(g1_dir / MARKER, grey_png())]
    todo = []
    for path, content in wanted:
        if not path.exists():
            todo.append((path, content))
        elif path.is_file() and path.read_bytes() == content:
            report.already.append(path)
        else:
            report.kept.append(path)
    report.created = [path for path, _ in todo]
    if dry_run:
        return report
    made_dirs, written = [], []
    try:
        for path, content in todo:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True)
                made_dirs.append(path.parent)
            with open(path, "xb") as handle:  # exclusive: never replaces a file that appeared meanwhile
                written.append(path)
                handle.write(content)
    except OSError as exc:
        failed = path
        for done in written:  # all or nothing
            done.unlink(missing_ok=True)
        for directory in reversed(made_dirs):
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
        raise AssetWriteError(f"could not write {failed}: {exc.strerror or exc}; nothing changed") from exc
    return report
