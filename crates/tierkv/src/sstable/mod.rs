//! The shared SSTable format: sorted data blocks, an index block, a bloom filter block and a
//! footer, each block checksummed (docs/format/sstable.md). Used by `slmdb` and meant for
//! the other disk-backed presets.
//!
//! # Layout
//! ```text
//! data block 0 | data block 1 | ... | index block | filter block | footer (48 bytes)
//! ```
//! A data block holds entries `kind u8 | klen u16 | vlen u32 | key | value` in strictly
//! increasing key order, followed by a masked crc32c of the block. A block is closed once
//! it holds at least `block_size` bytes (default 4 KiB), so an entry larger than that gets a
//! block of its own. The index block lists, per data block, its last key and handle; the
//! filter block is one bloom filter over every key of the file (10 bits per key by
//! default, `k = bits_per_key * ln 2`); the footer carries the magic, the format version,
//! both handles and the entry count, and its own checksum.
//!
//! Keys in one table are unique: a table is written from a memtable or a merge, which both
//! keep only the newest version of a key.
//!
//! # Reading
//! [`Table::open`] reads and verifies the footer, index and filter into DRAM; point reads
//! then cost one block read ([`Table::get`]), or exactly one when the caller already knows
//! the block ([`Table::read_block`] with a [`Handle`], as SLM-DB's location objects do).
//! Every block is verified before a read uses it (a mapped table's block once per open
//! table, below); a bad block is [`Error::Corruption`] naming the file and offset. An optional [`BlockCache`] (shared by a store's tables, keyed by file number and
//! block offset, weighted by bytes) keeps verified blocks in DRAM, as LevelDB's block cache
//! does; blocks read by whole-table scans (merges, `check`) bypass it.
//!
//! A mapped table's blocks are read in place ([`Table::block_ref`]), with no cache to hold
//! them verified, so the open [`Table`] keeps one bit per data block: set once the block's
//! checksum matched, after which in-place reads of it skip the checksum (measured before
//! this: a `slmdb` range read re-verified every block it touched, 24 % of seekrandom's
//! samples at 500,000 keys). This is weaker than a block cache in one case, stated
//! plainly: the mapping is the page cache, and a page the kernel evicts is read from the
//! device again at the next access, unchecked — damage the device introduces *after* a
//! block's first read in this open table (silent media corruption on a re-read) reaches
//! reads, and is caught by `check`, by merges and by the next open instead. (LevelDB, by
//! default, verifies no block on reads at all; RocksDB verifies a block when it enters its
//! cache.) Whole-table scans (`check`, merges) read through [`Table::read_block`], which
//! verifies every time; a table opened again (a reopen) starts with no bits set. A read
//! of a block already verified touches none of its trailer (the checksum's cache line).
//!
//! The open table also keeps a flat summary of its index (`Seps`): the 8 bytes of each
//! block's last key after the prefix all of them share, as integers, and a slot table from
//! a block's offset to its ordinal. [`Table::block_for`] binary-searches the integers and compares whole keys only
//! among the blocks whose 8 bytes tie with the key's; finding a block's verified bit from
//! its handle reads the slot table (see `Seps`; a binary search over the index's offsets
//! for a table too irregular for one). Both replace binary searches over the index
//! entries themselves (a probe of the key search paid two dependent cache misses: the entry,
//! then its separately allocated key).

pub(crate) mod bloom;

use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{crc, Cursor};
use crate::fs::{Fs, FsFile};

pub use bloom::Bloom;

/// File magic, at the start of the footer.
pub const MAGIC: &[u8; 8] = b"TKVSST\0\0";
/// Format version written in the footer.
pub const VERSION: u32 = 1;
/// Footer length.
pub const FOOTER_LEN: usize = 48;
/// Bytes of an entry header (`kind u8 | klen u16 | vlen u32`).
pub const ENTRY_HEADER: usize = 7;

/// Entry kinds. Never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value.
    Put = 0,
    /// A deletion marker.
    Delete = 1,
}

/// Where a block is in its file: offset and size (trailer included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Handle {
    /// Byte offset of the block.
    pub offset: u64,
    /// Bytes of the block including its 4-byte checksum.
    pub size: u32,
}

/// What a finished table holds.
#[derive(Debug, Clone, Default)]
pub struct TableMeta {
    /// Entries written.
    pub entries: u64,
    /// File size in bytes.
    pub size: u64,
    /// Smallest key (empty when there are no entries).
    pub smallest: Vec<u8>,
    /// Largest key.
    pub largest: Vec<u8>,
    /// Data blocks in file order.
    pub blocks: Vec<Handle>,
    /// For entry `i` (in the order added), the index into `blocks` of the block holding it.
    pub entry_block: Vec<u32>,
    /// For entry `i`, the offset of its first byte in its block's payload (where
    /// [`DecodedBlock::entry_at`] decodes it without the entries before it).
    pub entry_pos: Vec<u32>,
}

/// Where a builder's bytes go: a file, or memory (tables that live in PM are built in
/// DRAM and copied into their extent in one piece). File writes are gathered into
/// [`SINK_BUFFER`]-byte appends: one write per block made the kernel zero the partial
/// page each block ended in (9 % of the samples of a hoakv load profile) and cost a system
/// call per block.
#[derive(Debug)]
enum Sink {
    File(Box<dyn FsFile>, Vec<u8>),
    Mem(Vec<u8>),
}

/// Bytes a file-backed builder gathers before it appends them.
const SINK_BUFFER: usize = 256 << 10;

impl Sink {
    fn append(&mut self, data: &[u8]) -> Result<()> {
        match self {
            Sink::File(f, buf) => {
                buf.extend_from_slice(data);
                if buf.len() >= SINK_BUFFER {
                    f.append(buf)?;
                    buf.clear();
                }
            }
            Sink::Mem(v) => v.extend_from_slice(data),
        }
        Ok(())
    }

    /// Write out what is gathered.
    fn flush(&mut self) -> Result<()> {
        if let Sink::File(f, buf) = self {
            if !buf.is_empty() {
                f.append(buf)?;
                buf.clear();
            }
        }
        Ok(())
    }
}

/// Writes a table through the file seam. Call [`TableBuilder::add`] in strictly increasing
/// key order, then [`TableBuilder::finish`] (which fsyncs).
#[derive(Debug)]
pub struct TableBuilder {
    file: Sink,
    block_size: usize,
    bloom_bits: u32,
    block: Vec<u8>,
    block_last: Vec<u8>,
    index: Vec<(Vec<u8>, Handle)>,
    hashes: Vec<u64>,
    offset: u64,
    meta: TableMeta,
}

impl TableBuilder {
    /// Create `path` (truncating it).
    pub fn create(fs: &dyn Fs, path: &Path, block_size: usize, bloom_bits_per_key: u32) -> Result<Self> {
        Ok(Self::with_sink(Sink::File(fs.create(path)?, Vec::new()), block_size, bloom_bits_per_key))
    }

    /// A builder whose table is assembled in memory; [`TableBuilder::finish_mem`] returns
    /// the bytes.
    pub fn in_memory(block_size: usize, bloom_bits_per_key: u32) -> Self {
        Self::with_sink(Sink::Mem(Vec::new()), block_size, bloom_bits_per_key)
    }

    fn with_sink(file: Sink, block_size: usize, bloom_bits_per_key: u32) -> Self {
        TableBuilder {
            file,
            block_size: block_size.max(64),
            bloom_bits: bloom_bits_per_key,
            block: Vec::with_capacity(block_size + 1024),
            block_last: Vec::new(),
            index: Vec::new(),
            hashes: Vec::new(),
            offset: 0,
            meta: TableMeta::default(),
        }
    }

    /// Bytes written so far (closed blocks) plus the open block.
    pub fn approximate_size(&self) -> u64 {
        self.offset + self.block.len() as u64
    }

    /// Entries added so far.
    pub fn entries(&self) -> u64 {
        self.meta.entries
    }

    /// Add an entry; keys must be strictly increasing.
    pub fn add(&mut self, kind: Kind, key: &[u8], value: &[u8]) -> Result<()> {
        if self.meta.entries > 0 && key <= self.meta.largest.as_slice() {
            return Err(Error::InvalidArgument("SSTable keys must be strictly increasing".into()));
        }
        let klen =
            u16::try_from(key.len()).map_err(|_| Error::InvalidArgument("key too long for an SSTable".into()))?;
        let vlen =
            u32::try_from(value.len()).map_err(|_| Error::InvalidArgument("value too long for an SSTable".into()))?;
        let pos = u32::try_from(self.block.len())
            .map_err(|_| Error::InvalidArgument("SSTable block larger than 4 GiB".into()))?;
        self.block.push(kind as u8);
        self.block.extend_from_slice(&klen.to_le_bytes());
        self.block.extend_from_slice(&vlen.to_le_bytes());
        self.block.extend_from_slice(key);
        self.block.extend_from_slice(value);
        if self.meta.entries == 0 {
            self.meta.smallest = key.to_vec();
        }
        self.meta.largest = key.to_vec();
        self.block_last.clear();
        self.block_last.extend_from_slice(key);
        self.meta.entries += 1;
        self.meta.entry_block.push(self.meta.blocks.len() as u32);
        self.meta.entry_pos.push(pos);
        self.hashes.push(bloom::hash(key));
        if self.block.len() >= self.block_size {
            self.close_block()?;
        }
        Ok(())
    }

    fn close_block(&mut self) -> Result<()> {
        if self.block.is_empty() {
            return Ok(());
        }
        let c = crc::masked(&self.block);
        self.block.extend_from_slice(&c.to_le_bytes());
        let h = Handle { offset: self.offset, size: self.block.len() as u32 };
        self.file.append(&self.block)?;
        self.offset += self.block.len() as u64;
        self.meta.blocks.push(h);
        self.index.push((std::mem::take(&mut self.block_last), h));
        self.block.clear();
        Ok(())
    }

    /// Write index, filter and footer, fsync, and return what the table holds.
    pub fn finish(mut self) -> Result<TableMeta> {
        self.finish_body()?;
        self.file.flush()?;
        if let Sink::File(f, _) = &mut self.file {
            f.sync()?;
        }
        Ok(self.meta)
    }

    /// Finish an [`TableBuilder::in_memory`] table: what it holds and its bytes.
    pub fn finish_mem(mut self) -> Result<(TableMeta, Vec<u8>)> {
        self.finish_body()?;
        match self.file {
            Sink::Mem(v) => Ok((self.meta, v)),
            Sink::File(..) => Err(Error::InvalidArgument("finish_mem on a file-backed table builder".into())),
        }
    }

    fn finish_body(&mut self) -> Result<()> {
        self.close_block()?;
        let mut idx = Vec::new();
        for (k, h) in &self.index {
            idx.extend_from_slice(&(k.len() as u16).to_le_bytes());
            idx.extend_from_slice(k);
            idx.extend_from_slice(&h.offset.to_le_bytes());
            idx.extend_from_slice(&h.size.to_le_bytes());
        }
        let index_h = self.write_block(idx)?;
        let filter = Bloom::build(&self.hashes, self.bloom_bits).encode();
        let filter_h = self.write_block(filter)?;
        let footer = encode_footer(index_h, filter_h, self.meta.entries);
        self.file.append(&footer)?;
        self.offset += footer.len() as u64;
        self.meta.size = self.offset;
        Ok(())
    }

    fn write_block(&mut self, mut b: Vec<u8>) -> Result<Handle> {
        let c = crc::masked(&b);
        b.extend_from_slice(&c.to_le_bytes());
        let h = Handle { offset: self.offset, size: b.len() as u32 };
        self.file.append(&b)?;
        self.offset += b.len() as u64;
        Ok(h)
    }
}

/// Encode the 48-byte footer.
pub fn encode_footer(index: Handle, filter: Handle, entries: u64) -> [u8; FOOTER_LEN] {
    let mut f = [0u8; FOOTER_LEN];
    let mut w = Vec::with_capacity(FOOTER_LEN);
    w.extend_from_slice(MAGIC);
    w.extend_from_slice(&VERSION.to_le_bytes());
    w.extend_from_slice(&index.offset.to_le_bytes());
    w.extend_from_slice(&index.size.to_le_bytes());
    w.extend_from_slice(&filter.offset.to_le_bytes());
    w.extend_from_slice(&filter.size.to_le_bytes());
    w.extend_from_slice(&entries.to_le_bytes());
    let c = crc::masked(&w);
    w.extend_from_slice(&c.to_le_bytes());
    f.copy_from_slice(&w);
    f
}

/// An entry decoded from a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    /// Put or delete.
    pub kind: Kind,
    /// The key.
    pub key: &'a [u8],
    /// The value (empty for a delete).
    pub value: &'a [u8],
}

/// The entry starting at byte `pos` of a verified block's payload and the offset just
/// past it; an error names the offset of a malformed entry.
pub fn entry_at(payload: &[u8], pos: usize) -> std::result::Result<(Entry<'_>, usize), String> {
    let mut c = Cursor::new(payload.get(pos..).unwrap_or(&[]));
    let r = (|| {
        let kind = match c.u8()? {
            0 => Kind::Put,
            1 => Kind::Delete,
            _ => return None,
        };
        let klen = c.u16()? as usize;
        let vlen = c.u32()? as usize;
        let key = c.bytes(klen)?;
        let value = c.bytes(vlen)?;
        Some(Entry { kind, key, value })
    })();
    r.map(|e| (e, pos + c.pos())).ok_or_else(|| format!("malformed entry at block offset {}", pos + c.pos()))
}

/// Entries of a verified block's payload (checksum already stripped).
pub fn block_entries(payload: &[u8]) -> impl Iterator<Item = std::result::Result<Entry<'_>, String>> + '_ {
    let mut pos = 0;
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed || pos >= payload.len() {
            return None;
        }
        Some(match entry_at(payload, pos) {
            Ok((e, next)) => {
                pos = next;
                Ok(e)
            }
            Err(d) => {
                failed = true;
                Err(d)
            }
        })
    })
}

/// Find `key` in a verified block payload.
pub fn block_find<'a>(payload: &'a [u8], key: &[u8]) -> std::result::Result<Option<Entry<'a>>, String> {
    for e in block_entries(payload) {
        let e = e?;
        match e.key.cmp(key) {
            std::cmp::Ordering::Less => continue,
            std::cmp::Ordering::Equal => return Ok(Some(e)),
            std::cmp::Ordering::Greater => return Ok(None),
        }
    }
    Ok(None)
}

#[derive(Debug, Clone)]
struct BlockWeighter;

impl quick_cache::Weighter<(u64, u64), Arc<Vec<u8>>> for BlockWeighter {
    fn weight(&self, _key: &(u64, u64), val: &Arc<Vec<u8>>) -> u64 {
        val.len() as u64 + 64
    }
}

/// A DRAM cache of verified data blocks, shared by the tables of one store.
pub struct BlockCache {
    cache: quick_cache::sync::Cache<(u64, u64), Arc<Vec<u8>>, BlockWeighter>,
}

impl std::fmt::Debug for BlockCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache").field("bytes", &self.cache.weight()).finish()
    }
}

impl BlockCache {
    /// A cache holding up to `bytes` of blocks (4 KiB blocks assumed for sizing).
    pub fn new(bytes: u64) -> Arc<BlockCache> {
        let items = (bytes / 4096).max(16) as usize;
        Arc::new(BlockCache { cache: quick_cache::sync::Cache::with_weighter(items, bytes.max(1), BlockWeighter) })
    }

    /// Bytes cached.
    pub fn bytes(&self) -> u64 {
        self.cache.weight()
    }
}

/// An open table: footer, index and filter in DRAM.
#[derive(Debug)]
pub struct Table {
    file: Box<dyn FsFile>,
    cache: Option<(u64, Arc<BlockCache>)>,
    path: PathBuf,
    index: Vec<(Vec<u8>, Handle)>,
    filter: Bloom,
    entries: u64,
    size: u64,
    /// Bit `i`: data block `i` (of `index`) was read in place and its checksum matched.
    verified: Box<[AtomicU64]>,
    /// The search accelerator for `index` (see [`Seps`]).
    seps: Seps,
}

/// A flat, cache-friendly summary of a table's index for [`Table::block_for`] and
/// [`Table::block_ordinal`]. The index's keys are separate heap allocations, so a binary
/// search over them paid two dependent cache misses per probe (the entry, then its key's
/// bytes): 12 % of a hoakv range read's samples went to the search over its level-0
/// tables' indexes (64 MiB tables, about 16,000 blocks each), measured at 500,000 × 1 KiB. Every
/// last key of a table shares the prefix of its first and last ones (`common` bytes);
/// `prefix[i]` is the next 8 bytes of block `i`'s last key, big-endian, zero-padded, so
/// comparing two of them as integers orders the keys whenever they differ, and only the
/// blocks whose 8 bytes equal the key's are compared in full.
///
/// A block's ordinal from its handle (SLM-DB's locations name blocks by handle): block
/// starts strictly increase, each at least `gap` (the smallest measured difference) after
/// the one before, so `offset / gap` differs for every block. `slots[offset / gap]` is the
/// ordinal + 1 of the block starting in that slot (0: none), and the index entry of that
/// ordinal confirms the handle: two reads instead of a binary search (the search and its
/// index check were ~9 % of an slmdb range read's samples). Blocks close at `block_size`
/// bytes, so the slot table is about as long as the index; a table whose block sizes vary
/// so much that it would be over eight times longer (one huge entry among small blocks),
/// or whose offsets do not increase, gets none and is searched.
#[derive(Debug, Default)]
struct Seps {
    common: Vec<u8>,
    prefix: Box<[u64]>,
    gap: u64,
    slots: Box<[u32]>,
}

/// The 8 bytes of `k` after `skip`, big-endian, zero-padded.
fn prefix8(k: &[u8], skip: usize) -> u64 {
    let mut b = [0u8; 8];
    let tail = k.get(skip..).unwrap_or(&[]);
    let n = tail.len().min(8);
    b[..n].copy_from_slice(&tail[..n]);
    u64::from_be_bytes(b)
}

impl Seps {
    fn new(index: &[(Vec<u8>, Handle)]) -> Seps {
        let common = match (index.first(), index.last()) {
            (Some((a, _)), Some((b, _))) => {
                let n = a.iter().zip(b.iter()).take_while(|(x, y)| x == y).count();
                a[..n].to_vec()
            }
            _ => Vec::new(),
        };
        let gap = index.windows(2).map(|w| w[1].1.offset.saturating_sub(w[0].1.offset)).min().unwrap_or(1).max(1);
        let last = index.last().map_or(0, |e| e.1.offset);
        // Slots for the span the blocks cover; a table whose block sizes vary so much that
        // the slot table would dwarf its index (or whose offsets are not increasing) keeps
        // none and is searched.
        let count = usize::try_from(last / gap + 1).unwrap_or(usize::MAX);
        let increasing = index.windows(2).all(|w| w[0].1.offset < w[1].1.offset);
        let slots = if increasing && count <= 8 * index.len() + 64 && u32::try_from(index.len()).is_ok() {
            let mut slots = vec![0u32; count].into_boxed_slice();
            for (i, (_, h)) in index.iter().enumerate() {
                if let Some(s) = slots.get_mut((h.offset / gap) as usize) {
                    *s = i as u32 + 1;
                }
            }
            slots
        } else {
            Box::default()
        };
        Seps { prefix: index.iter().map(|(k, _)| prefix8(k, common.len())).collect(), gap, slots, common }
    }
}

impl Table {
    /// Open and verify the footer, index and filter of `path`.
    pub fn open(fs: &dyn Fs, path: &Path) -> Result<Arc<Table>> {
        Table::load(fs, path).map(Arc::new)
    }

    /// Open a table over an already opened `file` (e.g. a PM extent, [`crate::pm::PmFile`]);
    /// `path` names it in errors.
    pub fn open_file(file: Box<dyn FsFile>, path: &Path) -> Result<Arc<Table>> {
        Table::load_file(file, path).map(Arc::new)
    }

    fn load(fs: &dyn Fs, path: &Path) -> Result<Table> {
        Table::load_file(fs.open_immutable(path)?, path)
    }

    fn load_file(file: Box<dyn FsFile>, path: &Path) -> Result<Table> {
        let size = file.len()?;
        let bad = |off: u64, d: &str| Error::corruption(path, off, d.to_string());
        if size < FOOTER_LEN as u64 {
            return Err(bad(0, "SSTable shorter than its footer"));
        }
        let foot_off = size - FOOTER_LEN as u64;
        let mut foot = [0u8; FOOTER_LEN];
        read_exact(file.as_ref(), foot_off, &mut foot).map_err(|e| io_or(e, path, foot_off))?;
        let (index_h, filter_h, entries) = decode_footer(&foot).map_err(|d| bad(foot_off, &d))?;
        for h in [index_h, filter_h] {
            if h.offset.checked_add(h.size as u64).is_none_or(|e| e > foot_off) || h.size < 4 {
                return Err(bad(foot_off, "footer block handle outside the file"));
            }
        }
        let mut t = Table {
            file,
            cache: None,
            path: path.to_path_buf(),
            index: Vec::new(),
            filter: Bloom::default(),
            entries,
            size,
            verified: Box::default(),
            seps: Seps::default(),
        };
        let idx = t.read_block(index_h)?;
        let mut c = Cursor::new(&idx);
        while c.remaining() > 0 {
            let e = (|| {
                let klen = c.u16()? as usize;
                let k = c.bytes(klen)?.to_vec();
                let offset = c.u64()?;
                let size = c.u32()?;
                Some((k, Handle { offset, size }))
            })()
            .ok_or_else(|| bad(index_h.offset, "malformed index block"))?;
            if e.1.offset.checked_add(e.1.size as u64).is_none_or(|end| end > index_h.offset) || e.1.size < 4 {
                return Err(bad(index_h.offset, "index entry points outside the data blocks"));
            }
            t.index.push(e);
        }
        let fb = t.read_block(filter_h)?;
        t.filter = Bloom::decode(&fb).ok_or_else(|| bad(filter_h.offset, "malformed filter block"))?;
        t.verified = (0..t.index.len().div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        t.seps = Seps::new(&t.index);
        Ok(t)
    }

    /// DRAM the open table holds: its index entries (key, handle, vector overhead) and its
    /// bloom filter.
    pub fn dram_bytes(&self) -> u64 {
        let index: usize = self.index.iter().map(|(k, _)| k.len() + 24 + std::mem::size_of::<Handle>()).sum();
        let seps = self.seps.common.len() + self.seps.prefix.len() * 8 + self.seps.slots.len() * 4;
        (index + seps + self.filter.bytes() + self.verified.len() * 8 + std::mem::size_of::<Table>()) as u64
    }

    /// Open `path` as table number `id` whose point reads go through `cache`.
    pub fn open_cached(fs: &dyn Fs, path: &Path, id: u64, cache: &Arc<BlockCache>) -> Result<Arc<Table>> {
        let mut t = Table::load(fs, path)?;
        t.cache = Some((id, cache.clone()));
        Ok(Arc::new(t))
    }

    /// The ordinal of the data block `h` names exactly, if any (blocks are in file order).
    fn block_ordinal(&self, h: Handle) -> Option<usize> {
        let Seps { gap, slots, .. } = &self.seps;
        let i = if slots.is_empty() {
            self.index.binary_search_by_key(&h.offset, |(_, b)| b.offset).ok()?
        } else {
            (*slots.get(usize::try_from(h.offset / gap).ok()?)? as usize).checked_sub(1)?
        };
        (self.index.get(i)?.1 == h).then_some(i)
    }

    /// Whether the file is mapped (blocks are read in place, [`Table::block_ref`]).
    pub fn is_mapped(&self) -> bool {
        self.file.mapped().is_some()
    }

    /// Start loading `len` bytes at payload offset `pos` of block `h` (one entry's header
    /// and key, when the caller knows where the entry starts); nothing when the file is not
    /// mapped or the range is outside the block.
    pub fn prefetch_in_block(&self, h: Handle, pos: u32, len: usize) {
        let Some(map) = self.file.mapped() else { return };
        let Ok(start) = usize::try_from(h.offset) else { return };
        let end = (pos as usize).saturating_add(len).min(h.size as usize);
        let range = start.checked_add(pos as usize).zip(start.checked_add(end));
        if let Some(b) = range.and_then(|(a, b)| map.get(a..b)) {
            crate::pm::flush::prefetch(b);
        }
    }

    /// A block's payload without copying it, when the file is mapped; its checksum is
    /// verified when `verify` (callers skip it only for a block they verified already),
    /// unless a read of this data block verified it before (see "Reading" in the module
    /// docs).
    pub fn block_ref(&self, h: Handle, verify: bool) -> Result<Option<&[u8]>> {
        self.block_ref_at(h, None, verify)
    }

    /// [`Table::block_ref`] for a caller that knows the block's ordinal in the index
    /// (`Some(i)` only when `index()[i].1 == h`; checked).
    fn block_ref_at(&self, h: Handle, ordinal: Option<usize>, verify: bool) -> Result<Option<&[u8]>> {
        let Some(map) = self.file.mapped() else { return Ok(None) };
        let bad = |d: &str| Error::corruption(&self.path, h.offset, d.to_string());
        let start = usize::try_from(h.offset).map_err(|_| bad("block offset out of range"))?;
        let b = start
            .checked_add(h.size as usize)
            .and_then(|end| map.get(start..end))
            .filter(|b| b.len() >= 4)
            .ok_or_else(|| bad("block handle past the end of the file"))?;
        let (payload, c) = b.split_at(b.len() - 4);
        if verify {
            let ordinal = match ordinal {
                Some(i) if self.index.get(i).is_some_and(|e| e.1 == h) => Some(i),
                _ => self.block_ordinal(h),
            };
            let bit = ordinal.and_then(|i| Some((self.verified.get(i / 64)?, 1u64 << (i % 64))));
            if bit.is_none_or(|(w, m)| w.load(Ordering::Relaxed) & m == 0) {
                // The trailer is read only here: it is the block's last cache line, which
                // a read of a verified block need not touch.
                let stored = u32::from_le_bytes(c.try_into().unwrap_or([0; 4]));
                if crc::masked(payload) != stored {
                    return Err(bad("block checksum mismatch"));
                }
                if let Some((w, m)) = bit {
                    w.fetch_or(m, Ordering::Relaxed);
                }
            }
        }
        self.file.note_read(h.size as u64);
        Ok(Some(payload))
    }

    /// Start loading block `h` into the CPU caches when the file is mapped: a hint for a
    /// reader that knows which block it reads next (at most the first `max` bytes; nothing
    /// is read or verified, and a handle outside the file is ignored).
    pub fn prefetch_block(&self, h: Handle, max: usize) {
        self.prefetch_in_block(h, 0, max);
    }

    /// [`Table::read_block`] through the block cache, if the table has one.
    pub fn read_block_cached(&self, h: Handle) -> Result<Arc<Vec<u8>>> {
        let Some((id, cache)) = &self.cache else { return self.read_block(h).map(Arc::new) };
        if let Some(b) = cache.cache.get(&(*id, h.offset)) {
            return Ok(b);
        }
        let b = Arc::new(self.read_block(h)?);
        cache.cache.insert((*id, h.offset), b.clone());
        Ok(b)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Entries in the table (from the footer).
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// File size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Data block handles with their last keys.
    pub fn index(&self) -> &[(Vec<u8>, Handle)] {
        &self.index
    }

    /// Read and verify a block; returns its payload (checksum stripped).
    pub fn read_block(&self, h: Handle) -> Result<Vec<u8>> {
        if h.size < 4 || h.offset.checked_add(h.size as u64).is_none_or(|e| e > self.size) {
            return Err(Error::corruption(&self.path, h.offset, format!("block handle of {} bytes past end", h.size)));
        }
        let mut buf = vec![0u8; h.size as usize];
        read_exact(self.file.as_ref(), h.offset, &mut buf).map_err(|e| io_or(e, &self.path, h.offset))?;
        let n = buf.len() - 4;
        let stored = u32::from_le_bytes(buf.get(n..).and_then(|s| s.try_into().ok()).unwrap_or([0; 4]));
        buf.truncate(n);
        if crc::masked(&buf) != stored {
            return Err(Error::corruption(&self.path, h.offset, "block checksum mismatch"));
        }
        Ok(buf)
    }

    /// Index of the first data block whose last key is `>= key`.
    pub fn block_for(&self, key: &[u8]) -> Option<usize> {
        let Seps { common, prefix, .. } = &self.seps;
        let i = match key.get(..common.len()) {
            // Every last key starts with `common`: narrow by the next 8 bytes, then compare
            // in full only the blocks whose 8 bytes equal the key's.
            Some(head) if head == common.as_slice() => {
                let kp = prefix8(key, common.len());
                let lo = prefix.partition_point(|&p| p < kp);
                let hi = lo + prefix.get(lo..).unwrap_or(&[]).partition_point(|&p| p == kp);
                lo + self.index.get(lo..hi).unwrap_or(&[]).partition_point(|(last, _)| last.as_slice() < key)
            }
            // The key orders against `common` as against every last key.
            _ if key < common.as_slice() => 0,
            _ => self.index.len(),
        };
        (i < self.index.len()).then_some(i)
    }

    /// Point lookup: bloom filter, index, one block read. Returns the entry's kind and value.
    pub fn get(&self, key: &[u8]) -> Result<Option<(Kind, Vec<u8>)>> {
        if !self.filter.may_contain(bloom::hash(key)) {
            return Ok(None);
        }
        Ok(self.find(key)?.map(|(k, v, _)| (k, v)))
    }

    /// Like [`Table::get`], reading the block through the table's block cache.
    pub fn get_cached(&self, key: &[u8]) -> Result<Option<(Kind, Vec<u8>)>> {
        if !self.filter.may_contain(bloom::hash(key)) {
            return Ok(None);
        }
        let Some(i) = self.block_for(key) else { return Ok(None) };
        let Some(&(_, h)) = self.index.get(i) else { return Ok(None) };
        let b = self.read_block_cached(h)?;
        let e = block_find(&b, key).map_err(|d| Error::corruption(&self.path, h.offset, d))?;
        Ok(e.map(|e| (e.kind, e.value.to_vec())))
    }

    /// Point lookup that also returns the handle of the block holding the key.
    pub fn find(&self, key: &[u8]) -> Result<Option<(Kind, Vec<u8>, Handle)>> {
        let Some(i) = self.block_for(key) else { return Ok(None) };
        let Some(&(_, h)) = self.index.get(i) else { return Ok(None) };
        let b = self.read_block(h)?;
        let e = block_find(&b, key).map_err(|d| Error::corruption(&self.path, h.offset, d))?;
        Ok(e.map(|e| (e.kind, e.value.to_vec(), h)))
    }

    /// Every entry in key order with the handle of its block and its offset in the block's
    /// payload (a whole-table scan, for merges and `check`). Stops at the first error.
    pub fn for_each(&self, mut f: impl FnMut(Entry<'_>, Handle, u32) -> Result<()>) -> Result<()> {
        let mut prev: Option<Vec<u8>> = None;
        for &(ref last, h) in &self.index {
            let b = self.read_block(h)?;
            let mut block_last: Option<&[u8]> = None;
            let mut pos = 0;
            while pos < b.len() {
                let (e, next) = entry_at(&b, pos).map_err(|d| Error::corruption(&self.path, h.offset, d))?;
                if prev.as_deref().is_some_and(|p| p >= e.key) {
                    return Err(Error::corruption(&self.path, h.offset, "keys out of order"));
                }
                prev = Some(e.key.to_vec());
                block_last = Some(e.key);
                // `pos` < the block's size, a u32.
                f(e, h, pos as u32)?;
                pos = next;
            }
            if block_last != Some(last.as_slice()) {
                return Err(Error::corruption(&self.path, h.offset, "block's last key differs from the index"));
            }
        }
        Ok(())
    }
}

/// An entry a [`TableCursor`] yields: kind, key, value.
pub type CursorEntry = (Kind, Vec<u8>, Vec<u8>);

/// A forward cursor over one table's entries, one decoded block at a time (scans and
/// merges). `cached` reads blocks through the table's block cache.
#[derive(Debug)]
pub struct TableCursor {
    t: Arc<Table>,
    block: usize,
    ents: Vec<CursorEntry>,
    pos: usize,
    cached: bool,
}

impl TableCursor {
    /// A cursor at the first entry `>= start` (or `> start` for an excluded bound).
    pub fn seek(t: Arc<Table>, start: Bound<&[u8]>, cached: bool) -> Result<TableCursor> {
        let block = match start {
            Bound::Unbounded => 0,
            Bound::Included(k) | Bound::Excluded(k) => t.block_for(k).unwrap_or(t.index().len()),
        };
        let mut c = TableCursor { t, block, ents: Vec::new(), pos: 0, cached };
        c.load()?;
        while let Some(e) = c.peek() {
            let before = match start {
                Bound::Included(k) => e.1.as_slice() < k,
                Bound::Excluded(k) => e.1.as_slice() <= k,
                Bound::Unbounded => false,
            };
            if !before {
                break;
            }
            c.advance()?;
        }
        Ok(c)
    }

    fn load(&mut self) -> Result<()> {
        self.ents.clear();
        self.pos = 0;
        while self.ents.is_empty() {
            let Some(&(_, h)) = self.t.index().get(self.block) else { return Ok(()) };
            let payload = if self.cached { self.t.read_block_cached(h)? } else { Arc::new(self.t.read_block(h)?) };
            for e in block_entries(&payload) {
                let e = e.map_err(|d| Error::corruption(self.t.path(), h.offset, d))?;
                self.ents.push((e.kind, e.key.to_vec(), e.value.to_vec()));
            }
            if self.ents.is_empty() {
                self.block += 1;
            }
        }
        Ok(())
    }

    pub fn peek(&self) -> Option<&CursorEntry> {
        self.ents.get(self.pos)
    }

    pub fn advance(&mut self) -> Result<()> {
        self.pos += 1;
        if self.pos >= self.ents.len() {
            self.block += 1;
            self.load()?;
        }
        Ok(())
    }
}

/// Decode a footer: (index handle, filter handle, entries).
pub fn decode_footer(f: &[u8]) -> std::result::Result<(Handle, Handle, u64), String> {
    let mut c = Cursor::new(f);
    let magic = c.bytes(8).ok_or("short footer")?;
    if magic != MAGIC {
        return Err("bad SSTable magic".into());
    }
    let version = c.u32().ok_or("short footer")?;
    let index = Handle { offset: c.u64().ok_or("short footer")?, size: c.u32().ok_or("short footer")? };
    let filter = Handle { offset: c.u64().ok_or("short footer")?, size: c.u32().ok_or("short footer")? };
    let entries = c.u64().ok_or("short footer")?;
    let body = f.get(..FOOTER_LEN - 4).ok_or("short footer")?;
    let stored = c.u32().ok_or("short footer")?;
    if crc::masked(body) != stored {
        return Err("footer checksum mismatch".into());
    }
    if version != VERSION {
        return Err(format!("unsupported SSTable version {version}"));
    }
    Ok((index, filter, entries))
}

fn read_exact(f: &dyn FsFile, mut off: u64, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        let n = f.read_at(off, buf)?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short read"));
        }
        off += n as u64;
        buf = &mut buf[n..];
    }
    Ok(())
}

fn io_or(e: std::io::Error, path: &Path, off: u64) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::corruption(path, off, "file is truncated")
    } else {
        Error::Io(e)
    }
}

/// Offsets of one entry inside a block payload: a [`DecodedBlock`]'s entry table, and an
/// entry decoded on its own ([`DecodedBlock::entry_at`]), read back with
/// [`DecodedBlock::key_of`] and [`DecodedBlock::value_of`].
#[derive(Debug, Clone, Copy)]
pub struct EntryAt {
    kind: Kind,
    key: (u32, u32),
    value: (u32, u32),
}

impl EntryAt {
    /// The entry's kind.
    pub fn kind(&self) -> Kind {
        self.kind
    }
}

/// A verified data block decoded for stepping: its payload and where each decoded entry's
/// key and value are. Keys and values borrow from it; holding it pins the block.
///
/// Where the payload comes from ([`DecodedBlock::load`]): a block cache hit is shared with
/// the cache (verified when it was cached); otherwise a mapped table file's block is
/// verified (checksum) *in place* — at its first read by this open table, see "Reading" in
/// the module docs — and borrowed from the mapping — no copy, no allocation,
/// and the block cache is not filled (LevelDB's `fill_cache = false`, which its docs
/// recommend for scans: a scan's blocks would evict the point reads' working set, and
/// inserting and evicting them cost a fifth of a range read, measured). A file that is not
/// mapped is read (and cached when asked) as before. A caller whose store never caches a
/// mapped table's blocks (slmdb) asks for no cache on a mapped table
/// ([`Table::is_mapped`]), saving a lookup that would miss.
///
/// Entries are decoded as a reader reaches them ([`DecodedBlock::decode_to`],
/// [`DecodedBlock::lower_bound`]), as LevelDB parses a block while its iterator walks it:
/// a block holds no offsets of its entries, so each header's place is known only from the
/// one before it, and with large values each header is a cache line of its own — decoding
/// all of them at the load was a chain of dependent misses for entries most reads never
/// reach (with 1 KiB values a block holds ~4 entries and a seek needs half of them on
/// average, slmdb's cursor often one; with small values a seek still decodes about half
/// the block, as LevelDB's linear scan from a restart point does). Each decoded entry starts loading the next
/// header, so a walk finds it on its way. A malformed entry (a checksummed block written
/// wrong) is `Corruption` when it is reached, every time it is reached.
#[derive(Default)]
pub struct DecodedBlock {
    /// The table the block belongs to (`None` when empty): names it in errors, and keeps a
    /// mapped payload alive.
    table: Option<Arc<Table>>,
    /// The block's offset in the file.
    offset: u64,
    /// The payload when it is a verified copy: shared with the block cache (a hit), or read
    /// from a file that is not mapped. `None` when empty or borrowed from the mapping.
    owned: Option<Arc<Vec<u8>>>,
    /// The payload's bytes, kept by `owned` (its heap buffer) or by `table` (the mapping): every key and value read goes through this slice, and reaching the bytes
    /// through `data` or the table's file (two dynamic calls to find the mapping) was a
    /// twentieth of a range read's time (hoakv, stop 47). Never handed out as `'static`:
    /// [`DecodedBlock::bytes`] bounds it by `&self`.
    view: &'static [u8],
    /// The entries decoded so far, in block order.
    ents: Vec<EntryAt>,
    /// Payload offset of the first entry not decoded yet (the payload's length once all are).
    next: usize,
}

impl std::fmt::Debug for DecodedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodedBlock")
            .field("table", &self.table.as_ref().map(|t| t.path()))
            .field("offset", &self.offset)
            .field("len", &self.view.len())
            .field("owned", &self.owned.is_some())
            .field("decoded", &self.ents.len())
            .finish()
    }
}

impl DecodedBlock {
    /// Read block `h` of `t` (checksum verified; a cache hit shared when `cached`).
    pub fn read(t: &Arc<Table>, h: Handle, cached: bool) -> Result<DecodedBlock> {
        let mut b = DecodedBlock::default();
        b.load(t, h, cached)?;
        Ok(b)
    }

    /// [`DecodedBlock::read`] into this block, reusing its entry table. On an error the
    /// block is left empty.
    pub fn load(&mut self, t: &Arc<Table>, h: Handle, cached: bool) -> Result<()> {
        self.load_at(t, h, None, cached)
    }

    /// [`DecodedBlock::load`] of the block with ordinal `ordinal` in `t`'s index, when the
    /// caller knows it (saves a search for its verified bit).
    fn load_at(&mut self, t: &Arc<Table>, h: Handle, ordinal: Option<usize>, cached: bool) -> Result<()> {
        self.clear();
        let hit = match (&t.cache, cached) {
            (Some((id, cache)), true) => cache.cache.get(&(*id, h.offset)),
            _ => None,
        };
        let mut mapped: &[u8] = &[];
        self.owned = match hit {
            Some(b) => Some(b),
            None => match t.block_ref_at(h, ordinal, true)? {
                Some(p) => {
                    mapped = p;
                    None
                }
                None if cached => Some(t.read_block_cached(h)?),
                None => Some(Arc::new(t.read_block(h)?)),
            },
        };
        let view = self.owned.as_deref().map_or(mapped, Vec::as_slice);
        // SAFETY: `view` is either the heap buffer of the `Arc<Vec<u8>>` now in
        // `self.owned` (never mutated while shared, and it does not move when the `Arc` or
        // this block moves) or a slice of `t`'s file mapping (a read-only `mmap` of a
        // finished file, fixed for the file's life), which `self.table` keeps alive from
        // the next line on. Both live until `clear` or the next load, which reset `view`
        // first; the slice is only read through `bytes(&self)`, bounded by `&self`.
        self.view = unsafe { std::mem::transmute::<&[u8], &'static [u8]>(view) };
        self.table = Some(t.clone());
        self.offset = h.offset;
        Ok(())
    }

    /// Drop the payload (the entry table's allocation is kept).
    pub fn clear(&mut self) {
        self.view = &[];
        self.owned = None;
        self.table = None;
        self.ents.clear();
        self.next = 0;
    }

    fn bytes(&self) -> &[u8] {
        self.view
    }

    /// Decode one more entry; `false` when every entry is decoded.
    fn decode_one(&mut self) -> Result<bool> {
        let bytes = self.bytes();
        if self.next >= bytes.len() {
            return Ok(false);
        }
        let (ent, next) = self.decode_at(self.next)?;
        // The next header (and the start of its key): most likely read next.
        if let Some(h) = self.bytes().get(next..(next + 32).min(self.bytes().len())) {
            crate::pm::flush::prefetch(h);
        }
        self.ents.push(ent);
        self.next = next;
        Ok(true)
    }

    /// The entry starting at payload offset `pos`, and the offset just past it.
    fn decode_at(&self, pos: usize) -> Result<(EntryAt, usize)> {
        let bytes = self.bytes();
        match entry_at(bytes, pos) {
            Ok((e, next)) => {
                let base = bytes.as_ptr() as usize;
                let at = |s: &[u8]| ((s.as_ptr() as usize - base) as u32, s.len() as u32);
                Ok((EntryAt { kind: e.kind, key: at(e.key), value: at(e.value) }, next))
            }
            Err(d) => {
                let path = self.table.as_ref().map_or(Path::new(""), |t| t.path.as_path());
                Err(Error::corruption(path, self.offset, d))
            }
        }
    }

    /// Decode entries up to entry `i`: whether the block has one.
    pub fn decode_to(&mut self, i: usize) -> Result<bool> {
        while self.ents.len() <= i {
            if !self.decode_one()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Decode every entry: how many the block holds.
    pub fn decode_all(&mut self) -> Result<usize> {
        while self.decode_one()? {}
        Ok(self.ents.len())
    }

    /// Entries decoded so far (entry `i` can be read when `i < decoded()`).
    pub fn decoded(&self) -> usize {
        self.ents.len()
    }

    fn slice(&self, (off, len): (u32, u32)) -> &[u8] {
        self.bytes().get(off as usize..off as usize + len as usize).unwrap_or(&[])
    }

    /// Entry `i`'s key (empty when not decoded).
    pub fn key(&self, i: usize) -> &[u8] {
        self.ents.get(i).map_or(&[], |e| self.key_of(e))
    }

    /// Entry `i`'s value; `None` for a tombstone or an entry not decoded.
    pub fn value(&self, i: usize) -> Option<&[u8]> {
        self.value_of(self.ents.get(i)?)
    }

    /// Entry `i`'s kind (`None` when not decoded).
    pub fn kind(&self, i: usize) -> Option<Kind> {
        self.ents.get(i).map(|e| e.kind)
    }

    /// Entry `i`'s offsets (`None` when not decoded).
    pub fn entry(&self, i: usize) -> Option<EntryAt> {
        self.ents.get(i).copied()
    }

    /// The entry that starts at payload offset `pos`, decoded on its own — for a reader
    /// that knows where its entry starts ([`TableMeta::entry_pos`], kept by SLM-DB's
    /// location objects), which then reads none of the entries before it. The entry table
    /// is not changed. An offset that is not an entry's start decodes as garbage or fails:
    /// the caller checks the key it expects (the payload is verified, so a wrong offset is
    /// the caller's corruption to report).
    pub fn entry_at(&self, pos: usize) -> Result<EntryAt> {
        Ok(self.decode_at(pos)?.0)
    }

    /// The key of `e` (an entry of this block).
    pub fn key_of(&self, e: &EntryAt) -> &[u8] {
        self.slice(e.key)
    }

    /// The value of `e` (an entry of this block); `None` for a tombstone.
    pub fn value_of(&self, e: &EntryAt) -> Option<&[u8]> {
        match e.kind {
            Kind::Put => Some(self.slice(e.value)),
            Kind::Delete => None,
        }
    }

    /// Index of the first entry whose key is `>= key`, decoding up to it (the block's
    /// entry count, every entry decoded, when none).
    pub fn lower_bound(&mut self, key: &[u8]) -> Result<usize> {
        if self.ents.last().is_some_and(|e| self.slice(e.key) >= key) {
            return Ok(self.ents.partition_point(|e| self.slice(e.key) < key));
        }
        loop {
            if !self.decode_one()? {
                return Ok(self.ents.len());
            }
            if let Some(e) = self.ents.last() {
                if self.slice(e.key) >= key {
                    return Ok(self.ents.len() - 1);
                }
            }
        }
    }
}

/// A bidirectional [`crate::iter::InternalIterator`] over one table: one verified block
/// pinned at a time (shared with the block cache when `cached`), keys and values borrowed
/// from it, tombstones reported as `None`. Holding the `Arc<Table>` keeps the file open, so
/// the iterator reads on after a compaction deleted the file's name.
pub struct TableIter {
    t: Arc<Table>,
    cached: bool,
    /// Index of the loaded block (`index().len()` when none).
    block: usize,
    blk: DecodedBlock,
    /// The current entry (decoded); `>= blk.decoded()` when invalid.
    pos: usize,
}

impl std::fmt::Debug for TableIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableIter").field("table", &self.t.path).field("block", &self.block).finish()
    }
}

impl TableIter {
    /// An unpositioned iterator over `t`; `cached` reads blocks through the table's cache.
    pub fn new(t: Arc<Table>, cached: bool) -> TableIter {
        let block = t.index.len();
        TableIter { t, cached, block, blk: DecodedBlock::default(), pos: 0 }
    }

    /// The table read.
    pub fn table(&self) -> &Arc<Table> {
        &self.t
    }

    fn invalidate(&mut self) {
        self.blk.clear();
        self.pos = 0;
        self.block = self.t.index.len();
    }

    /// Load block `b` (no entry decoded yet); invalid past the last block.
    fn load(&mut self, b: usize) -> Result<()> {
        self.pos = 0;
        self.block = b;
        let Some(&(_, h)) = self.t.index.get(b) else {
            self.invalidate();
            return Ok(());
        };
        match self.blk.load_at(&self.t, h, Some(b), self.cached) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.invalidate();
                Err(e)
            }
        }
    }

    /// `r`, the iterator invalidated when it is an error.
    fn or_invalid<T>(&mut self, r: Result<T>) -> Result<T> {
        if r.is_err() {
            self.invalidate();
        }
        r
    }

    /// Load the first non-empty block at or after `b`, positioned at its first entry.
    fn forward_from(&mut self, mut b: usize) -> Result<()> {
        loop {
            self.load(b)?;
            let r = self.blk.decode_to(0);
            if self.or_invalid(r)? || self.block >= self.t.index.len() {
                return Ok(());
            }
            b += 1;
        }
    }

    /// Load the last non-empty block at or before `b`, positioned at its last entry.
    fn backward_from(&mut self, b: Option<usize>) -> Result<()> {
        let mut b = b;
        while let Some(i) = b {
            self.load(i)?;
            let r = self.blk.decode_all();
            if let Some(last) = self.or_invalid(r)?.checked_sub(1) {
                self.pos = last;
                return Ok(());
            }
            b = i.checked_sub(1);
        }
        self.invalidate();
        Ok(())
    }

    /// The current entry's kind.
    pub fn kind(&self) -> Option<Kind> {
        self.blk.kind(self.pos)
    }
}

impl crate::iter::InternalIterator for TableIter {
    fn valid(&self) -> bool {
        self.pos < self.blk.decoded()
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        let Some(b) = self.t.block_for(key) else {
            self.invalidate();
            return Ok(());
        };
        self.forward_from(b)?;
        let r = self.blk.lower_bound(key);
        self.pos = self.or_invalid(r)?;
        if self.pos >= self.blk.decoded() && self.block < self.t.index.len() {
            // The index's last key said the block holds a key >= `key`; a later block does.
            self.forward_from(self.block + 1)?;
        }
        Ok(())
    }

    fn seek_to_first(&mut self) -> Result<()> {
        self.forward_from(0)
    }

    fn seek_to_last(&mut self) -> Result<()> {
        self.backward_from(self.t.index.len().checked_sub(1))
    }

    fn next(&mut self) -> Result<()> {
        self.pos += 1;
        let r = self.blk.decode_to(self.pos);
        if !self.or_invalid(r)? {
            let b = self.block + 1;
            self.forward_from(b)?;
        }
        Ok(())
    }

    fn prev(&mut self) -> Result<()> {
        match self.pos.checked_sub(1) {
            Some(p) if self.valid() => {
                self.pos = p;
                Ok(())
            }
            _ => self.backward_from(self.block.checked_sub(1)),
        }
    }

    fn key(&self) -> &[u8] {
        self.blk.key(self.pos)
    }

    fn value(&self) -> Option<&[u8]> {
        self.blk.value(self.pos)
    }
}

#[cfg(test)]
mod iter_tests {
    use std::path::Path;

    use super::*;
    use crate::fs::FaultFs;
    use crate::iter::InternalIterator;

    /// Every seek and step over a multi-block table with tombstones matches the entry list.
    #[test]
    fn table_iter_walks_both_ways_and_seeks_between_blocks() {
        let fs = FaultFs::new();
        fs.create_dir_all(Path::new("/d")).unwrap();
        let mut b = TableBuilder::create(&fs, Path::new("/d/t.sst"), 128, 10).unwrap();
        let mut want = Vec::new();
        for i in 0..200u32 {
            let k = format!("k{:05}", i * 2).into_bytes();
            let v = (i % 7 != 0).then(|| format!("value-{i}").into_bytes());
            b.add(if v.is_some() { Kind::Put } else { Kind::Delete }, &k, v.as_deref().unwrap_or(&[])).unwrap();
            want.push((k, v));
        }
        b.finish().unwrap();
        let t = Table::open(&fs, Path::new("/d/t.sst")).unwrap();
        assert!(t.index().len() > 10, "the test needs many blocks");
        let mut it = TableIter::new(t, false);
        it.seek_to_first().unwrap();
        for (k, v) in &want {
            assert_eq!((it.key(), it.value()), (k.as_slice(), v.as_deref()));
            it.next().unwrap();
        }
        assert!(!it.valid());
        it.seek_to_last().unwrap();
        for (k, v) in want.iter().rev() {
            assert_eq!((it.key(), it.value()), (k.as_slice(), v.as_deref()));
            it.prev().unwrap();
        }
        assert!(!it.valid());
        for probe in 0..402u32 {
            let k = format!("k{probe:05}").into_bytes();
            it.seek(&k).unwrap();
            let p = want.partition_point(|e| e.0 < k);
            assert_eq!(it.valid(), p < want.len());
            if p < want.len() {
                assert_eq!(it.key(), want[p].0.as_slice());
            }
            it.seek_for_prev(&k).unwrap();
            match want.partition_point(|e| e.0 <= k).checked_sub(1) {
                Some(p) => assert_eq!(it.key(), want[p].0.as_slice()),
                None => assert!(!it.valid()),
            }
        }
        it.seek(b"zzz").unwrap();
        assert!(!it.valid());
    }

    /// A checksummed block holding a malformed entry (a writer bug, not media damage):
    /// entries are decoded as moves reach them, so a seek that lands before it serves
    /// entries, and every move that reaches it — a step, a seek past it, a backward move
    /// into its block — is `Corruption` and leaves the iterator invalid, every time.
    #[test]
    fn a_malformed_entry_is_reported_when_a_move_reaches_it() {
        let mut keys = None;
        let (_dir, t, _) = edited_mapped_table(|bytes, blocks| {
            let start = blocks[2].offset as usize;
            let end = start + blocks[2].size as usize - 4;
            let payload = &mut bytes[start..end];
            let (first, second) = entry_at(payload, 0).map(|(e, next)| (e.key.to_vec(), next)).unwrap();
            let after = entry_at(payload, second).map(|(e, _)| e.key.to_vec()).unwrap();
            payload[second] = 7; // not a kind
            let c = crc::masked(payload);
            bytes[end..end + 4].copy_from_slice(&c.to_le_bytes());
            keys = Some((first, after));
        });
        let (first, after) = keys.unwrap();
        let corrupt = |r: Result<()>| matches!(r, Err(Error::Corruption { .. }));
        let mut it = TableIter::new(t, false);
        for _ in 0..2 {
            it.seek(&first).unwrap();
            assert_eq!(it.key(), first.as_slice(), "the entry before the malformed one is served");
            assert!(corrupt(it.next()));
            assert!(!it.valid());
        }
        assert!(corrupt(it.seek(&after)), "a seek that must decode the entry");
        assert!(!it.valid());
        it.seek_to_last().unwrap();
        let mut r = Ok(());
        while it.valid() && r.is_ok() {
            r = it.prev();
        }
        assert!(corrupt(r), "a backward walk into the block");
        assert!(!it.valid());
        it.seek_to_first().unwrap();
        assert_eq!(it.key(), b"k00000", "other blocks still read");
    }

    /// A mapped table verifies a block at its first in-place read and marks it; a damaged
    /// block is reported at every read and never marked; `read_block` (check, merges)
    /// verifies regardless of the marks.
    #[test]
    fn mapped_blocks_are_verified_once_and_damage_is_never_marked() {
        // Block 2's payload damaged on disk, the table opened mapped.
        let (_dir, t, blocks) = damaged_mapped_table(2);
        let marked = |t: &Table, i: usize| t.verified[i / 64].load(Ordering::Relaxed) & (1 << (i % 64)) != 0;
        assert!(!marked(&t, 0));
        assert!(t.block_ref(blocks[0], true).unwrap().is_some());
        assert!(marked(&t, 0) && !marked(&t, 1));
        // Unverified reads mark nothing.
        assert!(t.block_ref(blocks[1], false).unwrap().is_some());
        assert!(!marked(&t, 1));
        for _ in 0..2 {
            assert!(matches!(t.block_ref(blocks[2], true), Err(Error::Corruption { .. })));
            assert!(!marked(&t, 2));
            assert!(matches!(t.read_block(blocks[2]), Err(Error::Corruption { .. })));
        }
        // A handle that names no block exactly is verified and not marked.
        let odd = Handle { offset: blocks[0].offset, size: blocks[0].size - 1 };
        assert!(t.block_ref(odd, true).is_err());
    }
}

/// A table of 100 small entries in several blocks, written to a temporary directory, with
/// data block `damaged`'s payload altered on disk, opened mapped: the directory (keep it
/// alive), the table and its blocks' handles.
#[cfg(test)]
fn damaged_mapped_table(damaged: usize) -> (tempfile::TempDir, Arc<Table>, Vec<Handle>) {
    edited_mapped_table(|bytes, blocks| bytes[blocks[damaged].offset as usize + 3] ^= 0x40)
}

/// The table of [`damaged_mapped_table`], its file's bytes changed by `edit` (given the
/// blocks' handles) before it is opened mapped.
#[cfg(test)]
fn edited_mapped_table(edit: impl FnOnce(&mut Vec<u8>, &[Handle])) -> (tempfile::TempDir, Arc<Table>, Vec<Handle>) {
    let dir = tempfile::tempdir().unwrap();
    let fs = crate::fs::RealFs;
    let path = dir.path().join("t.sst");
    let mut b = TableBuilder::create(&fs, &path, 128, 10).unwrap();
    for i in 0..100u32 {
        b.add(Kind::Put, format!("k{i:05}").as_bytes(), format!("value-{i}").as_bytes()).unwrap();
    }
    b.finish().unwrap();
    let blocks: Vec<Handle> = Table::open(&fs, &path).unwrap().index().iter().map(|e| e.1).collect();
    assert!(blocks.len() > 4, "the test needs several blocks");
    let mut bytes = std::fs::read(&path).unwrap();
    edit(&mut bytes, &blocks);
    std::fs::write(&path, &bytes).unwrap();
    let t = Table::open(&fs, &path).unwrap();
    assert!(t.file.mapped().is_some(), "RealFs maps immutable files");
    (dir, t, blocks)
}

#[cfg(test)]
mod seps_tests {
    use std::path::Path;

    use proptest::prelude::*;

    use super::*;
    use crate::fs::FaultFs;

    /// A table of `keys` in 64-byte blocks, each value `value(key)`.
    fn table(keys: &BTreeSet<Vec<u8>>, value: impl Fn(&[u8]) -> Vec<u8>) -> Arc<Table> {
        let fs = FaultFs::new();
        fs.create_dir_all(Path::new("/d")).unwrap();
        let mut b = TableBuilder::create(&fs, Path::new("/d/t.sst"), 64, 10).unwrap();
        for k in keys {
            b.add(Kind::Put, k, &value(k)).unwrap();
        }
        b.finish().unwrap();
        Table::open(&fs, Path::new("/d/t.sst")).unwrap()
    }

    /// On `t` (holding `keys`), the block a search picks through the prefix summary is the
    /// one a plain binary search over the index's last keys picks, for probes inside,
    /// before, after and beside the table's common prefix, short and zero-padded keys
    /// included; and every block's handle, and only it, gives its ordinal.
    fn check(t: &Table, keys: &BTreeSet<Vec<u8>>, probes: &[Vec<u8>]) {
        let naive = |k: &[u8]| {
            let i = t.index().partition_point(|(last, _)| last.as_slice() < k);
            (i < t.index().len()).then_some(i)
        };
        for p in probes.iter().chain(keys.iter()) {
            assert_eq!(t.block_for(p), naive(p), "probe {p:?}");
        }
        for (i, (_, h)) in t.index().iter().enumerate() {
            assert_eq!(t.block_ordinal(*h), Some(i));
            // Handles that name no block exactly have no ordinal.
            assert_eq!(t.block_ordinal(Handle { size: h.size + 1, ..*h }), None);
            assert_eq!(t.block_ordinal(Handle { offset: h.offset + 1, ..*h }), None);
            // The next block's start with this block's size names the next block or none.
            let next = t.index().get(i + 1).filter(|n| n.1.size == h.size).map(|_| i + 1);
            assert_eq!(t.block_ordinal(Handle { offset: h.offset + u64::from(h.size), ..*h }), next);
        }
    }

    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn block_for_matches_a_plain_search(
            prefix in proptest::collection::vec(prop_oneof![Just(0u8), Just(b'a'), Just(0xff)], 0..6),
            tails in proptest::collection::btree_set(proptest::collection::vec(prop_oneof![Just(0u8), Just(1u8), Just(b'a'), Just(0xff)], 0..12), 1..200),
            probes in proptest::collection::vec(proptest::collection::vec(prop_oneof![Just(0u8), Just(1u8), Just(b'a'), Just(0xff)], 0..16), 0..40),
        ) {
            let keys: BTreeSet<Vec<u8>> = tails.iter().map(|t| [prefix.as_slice(), t].concat()).collect();
            let mut all = probes.clone();
            all.extend(probes.iter().map(|p| [prefix.as_slice(), p].concat()));
            let t = table(&keys, |_| b"v".to_vec());
            prop_assert!(!t.seps.slots.is_empty(), "these tables get a slot table");
            check(&t, &keys, &all);
        }
    }

    /// One huge entry among small blocks leaves the table without a slot table; its
    /// ordinals come from a search, and agree.
    #[test]
    fn an_irregular_table_finds_ordinals_by_search() {
        let mut keys: BTreeSet<Vec<u8>> = (0..40u32).map(|i| format!("k{i:03}").into_bytes()).collect();
        keys.insert(b"k020x".to_vec());
        let t = table(&keys, |k| if k == b"k020x" { vec![7u8; 100_000] } else { b"v".to_vec() });
        assert!(t.seps.slots.is_empty(), "a slot table of {} for {} blocks", t.seps.slots.len(), t.index().len());
        check(&t, &keys, &[b"k020".to_vec(), b"k0201".to_vec(), b"k9".to_vec()]);
    }

    /// An ordinal hint that names another block is not trusted: a damaged block is
    /// reported even when the hint points at a block verified before.
    #[test]
    fn a_wrong_ordinal_hint_does_not_vouch_for_a_block() {
        let (_dir, t, blocks) = damaged_mapped_table(1);
        assert!(t.block_ref_at(blocks[0], Some(0), true).unwrap().is_some());
        assert!(matches!(t.block_ref_at(blocks[1], Some(0), true), Err(Error::Corruption { .. })));
        assert!(matches!(t.block_ref_at(blocks[1], Some(1), true), Err(Error::Corruption { .. })));
        assert!(t.block_ref_at(blocks[2], Some(1), true).unwrap().is_some());
    }

    #[test]
    fn block_for_on_db_bench_keys() {
        let keys: BTreeSet<Vec<u8>> =
            (0..3000u64).map(|i| format!("{:016}", i * 7919 % 100_000).into_bytes()).collect();
        let probes: Vec<Vec<u8>> = (0..500u64)
            .map(|i| format!("{:016}", i * 211).into_bytes())
            .chain([b"".to_vec(), b"0".to_vec(), b"1".to_vec(), b"00000000000999999".to_vec(), vec![0xff; 20]])
            .collect();
        let t = table(&keys, |_| b"v".to_vec());
        assert!(t.index().len() > 100 && t.seps.common.len() >= 10, "common prefix {:?}", t.seps.common);
        assert!(!t.seps.slots.is_empty());
        check(&t, &keys, &probes);
    }
}
