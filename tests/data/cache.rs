//! The latent and text caches: hits, misses, invalidation by content, resumption and
//! repair of damaged entries, and batches read back from disk.

use super::*;
use flame::data::FillReport;

/// A stand-in encoder: 4x4 mean pooling, (3, H, W) -> (3, H/4, W/4) "latents", plus a
/// per-call counter.
fn pool4(x: &Tensor) -> Result<Vec<(String, Tensor)>> {
    let d = x.dims();
    let (h, w) = (d[1] / 4, d[2] / 4);
    let v = x.to_vec::<f32>()?;
    let mut out = vec![0f32; 3 * h * w];
    for c in 0..3 {
        for y in 0..h {
            for xx in 0..w {
                let mut s = 0.0;
                for dy in 0..4 {
                    for dx in 0..4 {
                        s += v[(c * d[1] + y * 4 + dy) * d[2] + xx * 4 + dx];
                    }
                }
                out[(c * h + y) * w + xx] = s / 16.0;
            }
        }
    }
    Ok(vec![(
        "latents".into(),
        Tensor::from_vec(out, (3, h, w), &Device::Cpu)?,
    )])
}

fn fill(cache: &mut LatentCache, ds: &mut Dataset) -> (FillReport, usize, Vec<Progress>) {
    let mut calls = 0;
    let mut seen = vec![];
    let r = cache
        .fill(
            ds,
            &Device::Cpu,
            &mut |x| {
                calls += 1;
                pool4(x)
            },
            &mut |p| seen.push(*p),
        )
        .unwrap();
    (r, calls, seen)
}

fn cache_files(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

#[test]
fn latent_cache_hits_misses_and_invalidation() {
    let dir = TempDir::new("latent-cache");
    let imgs = dir.path().join("imgs");
    std::fs::create_dir_all(&imgs).unwrap();
    for i in 0..4u8 {
        put(
            &imgs,
            &format!("{i}.png"),
            &pattern(40 + 8 * i as u32, 32, i),
            Some("c"),
        );
    }
    let cdir = dir.path().join("cache");
    let mut o = options(&imgs, 32, 8);
    o.flip = true;
    let mut ds = Dataset::open(o.clone()).unwrap();
    let mut cache = LatentCache::open(&cdir, "pool4 v1").unwrap();

    // Four images, both mirrorings: 8 entries.
    let (r, calls, seen) = fill(&mut cache, &mut ds);
    assert_eq!(
        (r.total, r.computed, r.reused, r.repaired, calls),
        (8, 8, 0, 0, 8)
    );
    assert_eq!(seen.len(), 8);
    assert_eq!(
        seen.last().unwrap(),
        &Progress {
            done: 8,
            total: 8,
            reused: 0,
            computed: 8
        }
    );
    assert_eq!(cache_files(&cdir.join("latents")), 8);

    // Batches read back what the encoder made of the epoch's (mirrored or not) image.
    for e in 0..3 {
        for b in ds.sampler(2, false).unwrap().epoch(e) {
            let got = cache
                .load_batch(&ds, &b, e, &Device::Cpu, DType::F32)
                .unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].0, "latents");
            assert_eq!(got[0].1.dims()[0], b.len());
            for (k, &i) in b.iter().enumerate() {
                let want = pool4(&ds.image(i, e, &Device::Cpu).unwrap())
                    .unwrap()
                    .remove(0)
                    .1;
                let row = got[0].1.narrow(0, k, 1).unwrap().squeeze(0).unwrap();
                assert_eq!(row.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
            }
        }
    }

    // Nothing changed: all reused, no encoder call; a fresh cache object reads files.json.
    let mut cache = LatentCache::open(&cdir, "pool4 v1").unwrap();
    let (r, calls, _) = fill(&mut cache, &mut ds);
    assert_eq!((r.computed, r.reused, calls), (0, 8, 0));

    // A touched image (same bytes, new mtime) is rehashed and still hits.
    let p0 = imgs.join("0.png");
    let bytes = std::fs::read(&p0).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&p0, &bytes).unwrap();
    let (r, calls, _) = fill(&mut cache, &mut ds);
    assert_eq!((r.computed, r.reused, calls), (0, 8, 0));

    // One image changed (same size, so same bucket and crop): its 2 entries only.
    put(&imgs, "1.png", &pattern(48, 32, 99), None);
    let mut ds = Dataset::open(o.clone()).unwrap();
    let (r, calls, _) = fill(&mut cache, &mut ds);
    assert_eq!((r.computed, r.reused, calls), (2, 6, 2));

    // Another encoder: everything misses.
    let mut other = LatentCache::open(&cdir, "pool4 v2").unwrap();
    let (r, _, _) = fill(&mut other, &mut ds);
    assert_eq!((r.computed, r.reused), (8, 0));

    // Another resolution: other buckets and resizes, everything misses.
    let mut o2 = o.clone();
    o2.buckets.resolution = 24;
    let mut ds2 = Dataset::open(o2).unwrap();
    let (r, _, _) = fill(&mut cache, &mut ds2);
    assert_eq!((r.computed, r.reused), (8, 0));

    // Flips off: only the unmirrored entries, all present.
    let mut o3 = o.clone();
    o3.flip = false;
    let mut ds3 = Dataset::open(o3).unwrap();
    let (r, _, _) = fill(&mut cache, &mut ds3);
    assert_eq!((r.total, r.computed, r.reused), (4, 0, 4));
}

#[test]
fn latent_cache_repairs_and_resumes() {
    let dir = TempDir::new("latent-repair");
    let imgs = dir.path().join("imgs");
    std::fs::create_dir_all(&imgs).unwrap();
    for i in 0..5u8 {
        put(&imgs, &format!("{i}.png"), &pattern(32, 32, i), Some("c"));
    }
    let cdir = dir.path().join("cache");
    let mut ds = Dataset::open(options(&imgs, 32, 8)).unwrap();
    let mut cache = LatentCache::open(&cdir, "pool4").unwrap();

    // Interrupted after 2 entries: the encoder fails on its third call.
    let mut calls = 0;
    let e = cache
        .fill(
            &mut ds,
            &Device::Cpu,
            &mut |x| {
                calls += 1;
                if calls == 3 {
                    return Err(Error::Data {
                        path: "encoder".into(),
                        msg: "interrupted".into(),
                    });
                }
                pool4(x)
            },
            &mut |_| {},
        )
        .unwrap_err();
    assert!(e.to_string().contains("interrupted"));
    // Resumed: the 2 finished entries are reused.
    let (r, calls, _) = fill(&mut cache, &mut ds);
    assert_eq!((r.computed, r.reused, calls), (3, 2, 3));

    // A truncated entry and one overwritten with garbage are recomputed, not fatal.
    let e0 = cache.entry_path(&ds, 0, 0).unwrap();
    let e3 = cache.entry_path(&ds, 3, 0).unwrap();
    let bytes = std::fs::read(&e0).unwrap();
    std::fs::write(&e0, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::write(&e3, b"garbage").unwrap();
    // Reading a damaged entry names it.
    let err = cache
        .load_batch(&ds, &[0], 0, &Device::Cpu, DType::F32)
        .unwrap_err();
    assert!(err.to_string().contains(&e0.display().to_string()), "{err}");
    let (r, calls, _) = fill(&mut cache, &mut ds);
    assert_eq!((r.computed, r.repaired, r.reused, calls), (2, 2, 3, 2));
    let got = cache
        .load_batch(&ds, &[0, 3], 0, &Device::Cpu, DType::F32)
        .unwrap();
    assert_eq!(got[0].1.dims(), &[2, 3, 8, 8]);
    // No temporary files are left behind.
    let names: Vec<String> = std::fs::read_dir(cdir.join("latents"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n.ends_with(".safetensors") && !n.starts_with('.')),
        "{names:?}"
    );
}

#[test]
fn undecodable_image_at_fill() {
    let dir = TempDir::new("latent-bad");
    let imgs = dir.path().join("imgs");
    std::fs::create_dir_all(&imgs).unwrap();
    put(&imgs, "a.png", &pattern(32, 32, 1), Some("a"));
    let b = put(&imgs, "b.png", &pattern(32, 32, 2), Some("b"));
    // The header survives, the pixel data is cut: the scan passes, decoding fails.
    let bytes = std::fs::read(&b).unwrap();
    std::fs::write(&b, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let mut o = options(&imgs, 32, 8);
    let mut ds = Dataset::open(o.clone()).unwrap();
    assert_eq!(ds.len(), 2);
    let mut cache = LatentCache::open(dir.path().join("cache"), "pool4").unwrap();
    let e = cache
        .fill(&mut ds, &Device::Cpu, &mut pool4, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("b.png"), "{e}");

    o.on_bad_file = OnBadFile::Skip;
    let mut ds = Dataset::open(o).unwrap();
    let r = cache
        .fill(&mut ds, &Device::Cpu, &mut pool4, &mut |_| {})
        .unwrap();
    assert_eq!(r.skipped.len(), 1);
    assert!(r.skipped[0].path.ends_with("b.png"), "{:?}", r.skipped);
    assert_eq!(ds.len(), 1);
    assert_eq!(ds.items[0].name, "a.png");
    assert!(ds.skipped.iter().any(|s| s.path.ends_with("b.png")));
    cache
        .load_batch(&ds, &[0], 0, &Device::Cpu, DType::F32)
        .unwrap();
}

#[test]
fn text_cache_recomputes_only_changed_captions() {
    let dir = TempDir::new("text-cache");
    let imgs = dir.path().join("imgs");
    std::fs::create_dir_all(&imgs).unwrap();
    for i in 0..4u8 {
        put(
            &imgs,
            &format!("{i}.png"),
            &pattern(16, 16, i),
            Some(&format!("caption {i}")),
        );
    }
    let o = options(&imgs, 16, 8);
    let cdir = dir.path().join("cache");
    let cache = TextCache::open(&cdir, "clip-l f32").unwrap();
    // A stand-in encoder: the caption's bytes as an (L, 1) "embedding" and its length.
    let encoded = std::cell::RefCell::new(vec![]);
    let mut encode = |c: &str| -> Result<Vec<(String, Tensor)>> {
        encoded.borrow_mut().push(c.to_string());
        let mut v: Vec<f32> = c.bytes().map(f32::from).collect();
        v.resize(16, 0.0);
        Ok(vec![
            (
                "context".into(),
                Tensor::from_vec(v, (16, 1), &Device::Cpu)?,
            ),
            (
                "pooled".into(),
                Tensor::from_vec(vec![c.len() as f32], 1, &Device::Cpu)?,
            ),
        ])
    };
    let captions = |ds: &Dataset| -> Vec<String> {
        (0..ds.len()).map(|i| ds.caption(i, 0).unwrap()).collect()
    };
    let ds = Dataset::open(o.clone()).unwrap();
    let r = cache
        .fill(&captions(&ds), &mut encode, &mut |_| {})
        .unwrap();
    assert_eq!((r.total, r.computed, r.reused), (4, 4, 0));
    let r = cache
        .fill(&captions(&ds), &mut encode, &mut |_| {})
        .unwrap();
    assert_eq!((r.computed, r.reused), (0, 4));

    // Touch one caption: exactly one entry is recomputed.
    std::fs::write(imgs.join("2.txt"), "caption 2, edited").unwrap();
    let ds = Dataset::open(o.clone()).unwrap();
    let r = cache
        .fill(&captions(&ds), &mut encode, &mut |_| {})
        .unwrap();
    assert_eq!((r.computed, r.reused), (1, 3));
    assert_eq!(encoded.borrow().last().unwrap(), "caption 2, edited");
    assert_eq!(encoded.borrow().len(), 5);

    // Another encoder identity misses every caption.
    let other = TextCache::open(&cdir, "clip-l bf16").unwrap();
    let r = other
        .fill(&captions(&ds), &mut encode, &mut |_| {})
        .unwrap();
    assert_eq!((r.computed, r.reused), (4, 0));

    // A damaged entry is recomputed.
    std::fs::write(cache.entry_path("caption 0"), b"\x08\0\0\0\0\0\0\0{}").unwrap();
    let r = cache
        .fill(&captions(&ds), &mut encode, &mut |_| {})
        .unwrap();
    assert_eq!((r.computed, r.repaired, r.reused), (1, 1, 3));

    // A batch, read back per name, sorted.
    let got = cache
        .load_batch(
            &["caption 1".into(), "caption 3".into()],
            &Device::Cpu,
            DType::F32,
        )
        .unwrap();
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["context", "pooled"]);
    assert_eq!(got[0].1.dims(), &[2, 16, 1]);
    assert_eq!(got[1].1.to_vec::<f32>().unwrap(), [9.0, 9.0]);
    assert!(cache
        .load_batch(&["never cached".into()], &Device::Cpu, DType::F32)
        .is_err());
}

/// Processes filling one cache together (data-parallel training) each encode their share:
/// every entry once over all shares, an unreadable image listed by the process whose share
/// it is and left in every process's dataset; the whole fill after the shares then encodes
/// nothing and leaves the unreadable image out. Captions likewise.
#[test]
fn shares_of_a_fill_encode_each_entry_once() {
    let dir = TempDir::new("cache-shares");
    let imgs = dir.path().join("imgs");
    std::fs::create_dir_all(&imgs).unwrap();
    for i in 0..6u8 {
        put(
            &imgs,
            &format!("{i}.png"),
            &pattern(32 + 8 * (i as u32 % 2), 32, i),
            Some("c"),
        );
    }
    let bad = imgs.join("3.png");
    let bytes = std::fs::read(&bad).unwrap();
    std::fs::write(&bad, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let cdir = dir.path().join("cache");
    let mut o = options(&imgs, 32, 8);
    o.flip = true;
    o.on_bad_file = OnBadFile::Skip;
    let world = 4;
    let (mut computed, mut skipped) = (0, vec![]);
    for rank in 0..world {
        let mut ds = Dataset::open(o.clone()).unwrap();
        let mut cache = LatentCache::open(&cdir, "pool4").unwrap();
        let r = cache
            .fill_part(&mut ds, &Device::Cpu, &mut pool4, &mut |_| {}, rank, world)
            .unwrap();
        assert_eq!(r.reused, 0, "rank {rank}");
        assert_eq!(ds.len(), 6, "rank {rank}: a share leaves the dataset whole");
        computed += r.computed;
        skipped.extend(r.skipped.into_iter().map(|b| (rank, b.path)));
    }
    // Five readable images, both mirrorings, each encoded by one share; the damaged one
    // (item 3 in name order) belongs to rank 3.
    assert_eq!(computed, 10);
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].0, 3);
    assert!(skipped[0].1.ends_with("3.png"));
    for rank in 0..world {
        let mut ds = Dataset::open(o.clone()).unwrap();
        let mut cache = LatentCache::open(&cdir, "pool4").unwrap();
        let (r, calls, _) = fill(&mut cache, &mut ds);
        assert_eq!((r.computed, r.reused, calls), (0, 10, 0), "rank {rank}");
        assert_eq!(r.skipped.len(), 1);
        assert_eq!(ds.len(), 5);
    }

    let text = TextCache::open(&cdir, "lengths").unwrap();
    let captions: Vec<String> = ["a", "b", "a", "c", "dd", "e", "f", ""]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut encode = |c: &str| -> Result<Vec<(String, Tensor)>> {
        Ok(vec![(
            "len".into(),
            Tensor::from_vec(vec![c.len() as f32], 1, &Device::Cpu)?,
        )])
    };
    let mut computed = 0;
    for rank in 0..3 {
        let r = text
            .fill_part(&captions, &mut encode, &mut |_| {}, rank, 3)
            .unwrap();
        computed += r.computed;
        assert!(r.total == 2 || r.total == 3, "rank {rank}: {}", r.total);
    }
    assert_eq!(computed, 7);
    let r = text.fill(&captions, &mut encode, &mut |_| {}).unwrap();
    assert_eq!((r.computed, r.reused), (0, 7));
}

/// Batched fills: the missing captions of the share in sorted order, `batch` a call (the
/// last group smaller), the entries those of one at a time; reused captions are not
/// encoded again; an encoder that returns the wrong count is an error naming it.
#[test]
fn text_fills_in_batches_of_the_sorted_missing_captions() {
    let dir = TempDir::new("text-batches");
    let cdir = dir.path().join("cache");
    let len = |c: &str| -> Result<Vec<(String, Tensor)>> {
        Ok(vec![(
            "len".into(),
            Tensor::from_vec(vec![c.len() as f32, 1.0], 2, &Device::Cpu)?,
        )])
    };
    let captions: Vec<String> = ["e", "bb", "a", "ccc", "bb", "dddd", "", "ffffff"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    // One at a time into one cache, three a call into another: the same entries.
    let single = TextCache::open(&cdir, "single").unwrap();
    let r = single
        .fill(&captions, &mut |c| len(c), &mut |_| {})
        .unwrap();
    assert_eq!((r.total, r.computed), (7, 7));
    let batched = TextCache::open(&cdir, "batched").unwrap();
    let mut groups: Vec<Vec<String>> = vec![];
    let mut encode = |cs: &[&str]| -> Result<Vec<Vec<(String, Tensor)>>> {
        groups.push(cs.iter().map(|c| c.to_string()).collect());
        cs.iter().map(|c| len(c)).collect()
    };
    let mut ticks = 0;
    let r = batched
        .fill_batched(&captions, 3, &mut encode, &mut |_| ticks += 1, 0, 1)
        .unwrap();
    assert_eq!((r.total, r.computed, r.reused, ticks), (7, 7, 0, 7));
    assert_eq!(
        groups,
        [
            vec!["", "a", "bb"],
            vec!["ccc", "dddd", "e"],
            vec!["ffffff"]
        ]
    );
    for c in &captions {
        let a = single
            .load_batch(std::slice::from_ref(c), &Device::Cpu, DType::F32)
            .unwrap();
        let b = batched
            .load_batch(std::slice::from_ref(c), &Device::Cpu, DType::F32)
            .unwrap();
        assert_eq!(
            a[0].1.to_vec::<f32>().unwrap(),
            b[0].1.to_vec::<f32>().unwrap(),
            "{c:?}"
        );
    }
    // Two entries gone: only they are encoded, in one group.
    std::fs::remove_file(batched.entry_path("a")).unwrap();
    std::fs::remove_file(batched.entry_path("e")).unwrap();
    groups.clear();
    let mut encode = |cs: &[&str]| -> Result<Vec<Vec<(String, Tensor)>>> {
        groups.push(cs.iter().map(|c| c.to_string()).collect());
        cs.iter().map(|c| len(c)).collect()
    };
    let r = batched
        .fill_batched(&captions, 3, &mut encode, &mut |_| {}, 0, 1)
        .unwrap();
    assert_eq!((r.computed, r.reused), (2, 5));
    assert_eq!(groups, [vec!["a", "e"]]);
    // An encoder that drops a caption: an error, and no entry of its group written.
    std::fs::remove_file(batched.entry_path("a")).unwrap();
    let mut short = |cs: &[&str]| -> Result<Vec<Vec<(String, Tensor)>>> {
        cs.iter().skip(1).map(|c| len(c)).collect()
    };
    let e = batched
        .fill_batched(&captions, 3, &mut short, &mut |_| {}, 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("returned 0 entries for 1 captions"), "{e}");
    assert!(!batched.entry_path("a").exists());
}
