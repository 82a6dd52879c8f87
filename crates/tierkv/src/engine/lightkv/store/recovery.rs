//! Opening a store: the layout read back, the heap rebuilt, and the DRAM part restored from
//! the clean-shutdown image or rebuilt by scanning the write buffer (see "Recovery" in
//! [`super`]).

use super::*;

impl PwbStore {
    /// Open the store: PM layout in `region` (created when `create`), SSTables in `dir`.
    pub fn open(region: Arc<Region>, fs: Arc<dyn Fs>, dir: &Path, create: bool, cfg: StoreConfig) -> Result<PwbStore> {
        if create {
            let sb = encode_superblock(cfg.seg_size);
            // SAFETY: the layout area of a new store; nobody else uses the region yet.
            unsafe { region.write(SUPERBLOCK_ADDR, &sb)? };
            region.persist(SUPERBLOCK_ADDR, 64);
        }
        let sb = region.slice_checked(SUPERBLOCK_ADDR, 64, "lightkv superblock")?;
        let seg_size = decode_superblock(sb).map_err(|d| region.corruption(SUPERBLOCK_ADDR, d))?;
        let mut used: Vec<(u64, u64)> = Vec::new();
        // Segments.
        let mut segs = BTreeMap::new();
        let mut free_slots = Vec::new();
        for i in (0..SEG_SLOTS).rev() {
            let a = DIR_ADDR + i * SLOT_LEN;
            let id = region.load_u64_atomic(a + 8)?;
            if id == 0 {
                free_slots.push(i);
                continue;
            }
            let addr = region.load_u64_atomic(a)?;
            let h = region.slice_checked(addr, pwb::HEADER_LEN, "PWB segment header")?;
            let size = match pwb::decode_header(h) {
                Ok((hid, size)) if hid == id && size >= seg_size && size.is_multiple_of(64) => size,
                Ok(_) => return Err(region.corruption(addr, "segment header does not match its directory slot")),
                Err(d) => return Err(region.corruption(addr, d)),
            };
            used.push((addr, size));
            segs.insert(
                addr,
                Seg { slot: i, id, size, pos: AtomicU64::new(0), live: AtomicU64::new(0), active: false },
            );
        }
        // Chained partitions: descriptor and PM leaves.
        let mut t = RhTree::new(cfg.tree);
        let mut chains = HashMap::new();
        let mut free_chain_slots = Vec::new();
        let mut referenced_tables = std::collections::BTreeSet::new();
        let mut restored: Vec<(u64, Vec<Leaf>)> = Vec::new();
        for slot in (0..CHAIN_SLOTS).rev() {
            let ra = region.load_u64_atomic(CHAIN_DIR_ADDR + slot * 8)?;
            if ra == 0 {
                free_chain_slots.push(slot);
                continue;
            }
            let (chain, rlen) = read_chain(&region, ra)?;
            used.push((ra, line_round(rlen as u64)));
            let mut leaves = Vec::new();
            let mut dram = Vec::new();
            for &la in &chain.leaves {
                let h = region.slice_checked(la, LEAF_HEADER, "PM leaf header")?;
                let len = leaf_len(h).map_err(|d| region.corruption(la, d))?;
                let b = region.slice_checked(la, len, "PM leaf")?;
                let (leaf, meta) = decode_leaf(b).map_err(|d| region.corruption(la, d))?;
                if leaf.depth() != chain.desc.prefix.len() {
                    return Err(region.corruption(la, "PM leaf depth differs from its partition's"));
                }
                used.push((la, line_round(len as u64)));
                referenced_tables.insert(meta.table);
                leaves.push(pm_leaf(la, len as u64, meta, &leaf, cfg.placement));
                dram.push(leaf);
            }
            t.ensure_partition(&chain.desc, true).map_err(|d| region.corruption(ra, d))?;
            restored.push((slot, dram));
            chains.insert(slot, ChainInfo { record: (ra, rlen as u64), desc: chain.desc, leaves });
        }
        // Ids may change while partitions are restored: attach the tags once all are in.
        for (slot, _) in &restored {
            let d = &chains[slot].desc;
            let q =
                t.find_partition(d).ok_or_else(|| region.corruption(CHAIN_DIR_ADDR + slot * 8, "chain overlaps"))?;
            t.partition_mut(q).tag = slot + 1;
        }
        // The clean-shutdown image, if the last close wrote one.
        // It only saves the scan: a damaged or unreadable one is dropped, and the write buffer
        // is scanned instead.
        let img_addr = region.load_u64_atomic(IMAGE_PTR_ADDR)?;
        let mut image_rejected = 0;
        let image = if img_addr != 0 {
            let read = || -> std::result::Result<(Image, usize), String> {
                let h = region.slice(img_addr, IMAGE_HEADER).ok_or("image pointer outside PM")?;
                let len = image_len(h)?;
                let b = region.slice(img_addr, len).ok_or("image runs outside PM")?;
                Ok((decode_image(b)?, len))
            };
            match read() {
                Ok((img, len)) if !used.iter().any(|&(a, l)| a < img_addr + len as u64 && img_addr < a + l) => {
                    used.push((img_addr, line_round(len as u64)));
                    Some((img, len))
                }
                _ => {
                    image_rejected = 1;
                    None
                }
            }
        } else {
            None
        };
        let heap = heap::rebuild(&region, HEAP_START, used)?;
        // Tables: delete those no leaf names (a crash hit a flush before its commit).
        let mut next_table = referenced_tables.iter().next_back().map_or(1, |n| n + 1);
        if create {
            fs.create_dir_all(dir)?;
        }
        for name in fs.list(dir)? {
            if let Some(n) = name.strip_suffix(".sst").and_then(|n| n.parse::<u64>().ok()) {
                next_table = next_table.max(n + 1);
                if !referenced_tables.contains(&n) {
                    fs.remove(&dir.join(&name))?;
                }
            }
        }
        let st = State {
            tree: t,
            segs,
            active: HashMap::new(),
            free_slots,
            next_seq: AtomicU64::new(1),
            chains,
            free_chain_slots,
            emptied: Vec::new(),
            unflushed: HashMap::new(),
            flush_queue: VecDeque::new(),
            epoch: 0,
            chain_ver: 0,
            view: Mutex::new(SortedView::default()),
            replaying: false,
            images: HashMap::new(),
            chain_images: HashMap::new(),
            touched: Vec::new(),
            image_live: HashMap::new(),
        };
        let cache = (cfg.block_cache > 0).then(|| BlockCache::new(cfg.block_cache));
        let s = PwbStore {
            region,
            fs,
            dir: dir.to_path_buf(),
            cache,
            tables: Mutex::new(HashMap::new()),
            heap: Mutex::new(heap),
            state: RwLock::new(st),
            lanes: (0..LANES).map(|_| Mutex::new(())).collect(),
            queued: AtomicUsize::new(0),
            seg_size,
            next_table: AtomicU64::new(next_table),
            stats: Mutex::new(StoreStats::default()),
            pins: Pins::default(),
            view_used: AtomicU64::new(0),
            runs_cache: Mutex::new(None),
            flush_job: Mutex::new(()),
            compact_job: Mutex::new(()),
            work: Mutex::new(Work::default()),
            work_cv: Condvar::new(),
            flushed_cv: Condvar::new(),
            flushed_mu: Mutex::new(()),
            poisoned: Poison::default(),
            cancel: crate::jobs::Cancel::new(cfg.job_probe.clone()),
            user_bytes: Default::default(),
            probes: Default::default(),
            cfg,
        };
        s.stats.lock().image_rejected = image_rejected;
        let pm = s.cfg.placement == LightkvPlacement::Pm;
        match image {
            Some((img, len)) => s.restore_image(img, img_addr, len)?,
            None => {
                if img_addr != 0 {
                    // A rejected image: retire its pointer before the store takes a write.
                    s.region.store_u64_atomic(IMAGE_PTR_ADDR, 0)?;
                    s.region.persist(IMAGE_PTR_ADDR, 8);
                }
                s.replay()?
            }
        }
        if pm {
            // Images written while recovery replayed (untracked) may be stale: start afresh.
            let mut st = s.state.write();
            for (_, (a, l)) in std::mem::take(&mut st.images) {
                s.heap.lock().free(a, line_round(l));
            }
            st.image_live.clear();
            st.tree.set_track_dirty(true);
            s.sync_images(&mut st, true)?;
        }
        Ok(s)
    }

    /// Rebuild the DRAM part from the clean-shutdown image, then retire the image (cleared
    /// before any write, so a later crash recovers by scanning).
    pub(super) fn restore_image(&self, img: Image, img_addr: u64, len: usize) -> Result<()> {
        let bad = |d: String| self.region.corruption(img_addr, d);
        let mut st = self.state.write();
        for (d, _, _) in &img.partitions {
            if st.tree.find_partition(d).is_none() {
                st.tree.ensure_partition(d, false).map_err(|e| bad(format!("index image: {e}")))?;
            }
        }
        for (d, active, leaf) in img.partitions {
            let p = st.tree.find_partition(&d).ok_or_else(|| bad("index image partitions overlap".into()))?;
            if leaf.depth() != d.prefix.len() {
                return Err(bad("index image leaf does not fit its partition".into()));
            }
            for off in leaf.offsets() {
                match Self::seg_of(&st, off).and_then(|a| st.segs.get_mut(&a)) {
                    Some(g) if off & SST_FLAG == 0 => *g.live.get_mut() += 1,
                    _ => return Err(bad(format!("index image entry {off:#x} points outside the write buffer"))),
                }
            }
            *st.tree.partition_mut(p).top.get_mut() = leaf;
            if active != 0 {
                let g = st.segs.get_mut(&active).ok_or_else(|| bad("index image names a missing segment".into()))?;
                g.active = true;
                st.active.insert(p, active);
            }
        }
        for (a, pos) in img.segments {
            let g = st.segs.get_mut(&a).ok_or_else(|| bad("index image names a missing segment".into()))?;
            if pos < pwb::HEADER_LEN as u64 || pos > g.size {
                return Err(bad(format!("index image write position {pos} outside its segment")));
            }
            *g.pos.get_mut() = pos;
        }
        *st.next_seq.get_mut() = img.next_seq;
        st.emptied = st.segs.iter().filter(|(_, g)| g.live.load(Ordering::Relaxed) == 0).map(|(&a, _)| a).collect();
        // Retire the image before the store takes a write.
        self.region.store_u64_atomic(IMAGE_PTR_ADDR, 0)?;
        self.region.persist(IMAGE_PTR_ADDR, 8);
        self.heap.lock().free(img_addr, line_round(len as u64));
        self.free_emptied(&mut st)?;
        self.stats.lock().restored_from_image = 1;
        Ok(())
    }

    /// Rebuild the DRAM part by scanning every segment and re-indexing its records in
    /// sequence order.
    pub(super) fn replay(&self) -> Result<()> {
        let mut st = self.state.write();
        // (seq, entry index, entry address, key)
        let mut recs: Vec<(u64, usize, u64, Vec<u8>)> = Vec::new();
        let seg_list: Vec<(u64, u64, u64)> = st.segs.iter().map(|(&a, g)| (a, g.id, g.size)).collect();
        for (addr, id, size) in seg_list {
            let bytes = self.region.slice_checked(addr, size as usize, "PWB segment")?;
            let (rs, end) = pwb::scan(bytes, id).map_err(|(off, d)| self.region.corruption(addr + off as u64, d))?;
            if let Some(g) = st.segs.get_mut(&addr) {
                *g.pos.get_mut() = end as u64;
            }
            for r in rs {
                for (i, e) in r.entries.iter().enumerate() {
                    recs.push((r.seq, i, addr + e.off as u64, e.key.to_vec()));
                }
            }
        }
        recs.sort_unstable_by_key(|r| (r.0, r.1));
        *st.next_seq.get_mut() = recs.last().map_or(1, |r| r.0 + 1);
        st.replaying = true;
        let total = recs.len() as u64;
        let mut skipped = 0;
        for (seq, _, addr, key) in recs {
            let covered = st.tree.route(&key).is_some_and(|p| {
                let tag = st.tree.partition(p).tag;
                tag > 0
                    && st.chains.get(&(tag - 1)).and_then(|c| c.leaves.first()).is_some_and(|l| seq <= l.meta.seq_hi)
            });
            if covered {
                skipped += 1;
                continue;
            }
            self.index(&mut st, &key, addr, seq, true, None)?;
        }
        {
            let mut c = self.stats.lock();
            c.recovered_records = total;
            c.recovered_skipped = skipped;
        }
        // Every segment is inactive after recovery: those no entry points into go.
        st.replaying = false;
        st.emptied = st.segs.iter().filter(|(_, g)| g.live.load(Ordering::Relaxed) == 0).map(|(&a, _)| a).collect();
        self.free_emptied(&mut st)
    }
}
