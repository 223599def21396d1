"""The web page at / in a real headless browser (Debian's chromium, driven by selenium through chromium-driver):
load it, submit a prompt to the embedded default model, see progress (the live preview) and the finished image with
its parameters and download link, cancel a second job, then inpaint: upload an image and a mask and pick one of the
server's LoRAs (the inputs the page shows because GET /v1/page-config says FLUX.2 takes them); the screenshot is
docs/server.png. A text-only pipeline with no LoRAs offered gets none of those inputs."""

import shutil
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from PIL import Image

import mlxdiff
from mlxdiff import default_model
from mlxdiff.errors import MlxdiffError
from serve_helpers import call, running_server, shapes_lora

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "server.png"

# Not a skip: the README's test command installs both, so a missing browser is a set-up failure to see.
MISSING = "" if CHROMIUM and DRIVER else ("the web page's test needs Debian's chromium and chromium-driver "
                                          "(apt-get install -y chromium chromium-driver; the README's test command "
                                          "installs them)")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    if MISSING:
        pytest.fail(MISSING)
    pipe = mlxdiff.load(str(default_model.folder()), keep="auto")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # root, no screen, a closed network: no sandbox, and none of Chromium's own connections (updates, sync, first
    # run's lookups), which this machine refuses many at a time; a profile of its own
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}", "--window-size=1100,720"):
        options.add_argument(flag)
    lora = shapes_lora(tmp_path_factory.mktemp("lora") / "shapes-style.safetensors")
    with running_server(pipe, loras={"shapes-style": str(lora)}) as (base, _):
        browser = webdriver.Chrome(service=Service(DRIVER), options=options)
        try:
            browser.set_page_load_timeout(60)
            browser.set_script_timeout(30)
            browser.get(base + "/")
            browser.base = base
            yield browser
        finally:
            browser.quit()


def cards(browser):
    return browser.find_elements(By.CSS_SELECTOR, "#jobs .job")


def submit(browser, prompt, steps, seed):
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "steps").get_attribute("value"))
    for name, value in (("prompt", prompt), ("steps", steps), ("seed", seed)):
        field = browser.find_element(By.ID, name)
        field.clear()
        field.send_keys(str(value))
    before = len(cards(browser))
    browser.find_element(By.ID, "submit").click()
    WebDriverWait(browser, 20).until(lambda b: len(cards(b)) == before + 1)
    return cards(browser)[0]         # the newest card is first


def test_page_generates_cancels_and_inpaints(page, tmp_path):
    page.get(page.base + "/")           # afresh: another test may have led the browser elsewhere
    assert "klein-shapes" in WebDriverWait(page, 20).until(
        lambda b: b.find_element(By.ID, "model").text if "FLUX" in b.find_element(By.ID, "model").text else None)
    assert page.find_element(By.ID, "width").get_attribute("value") == "64"
    card = submit(page, default_model.PROMPT, 6, 7)
    WebDriverWait(page, 60).until(lambda b: card.get_attribute("data-status") in ("done", "error"))
    assert card.get_attribute("data-status") == "done", card.find_element(By.CLASS_NAME, "error").text
    assert card.get_attribute("data-last-step") == "6"               # progress seen up to the last step
    preview = card.find_element(By.CLASS_NAME, "preview").get_attribute("src")
    assert preview.startswith("data:image/png;base64,")               # the live preview was shown
    result = card.find_element(By.CLASS_NAME, "result")
    assert page.execute_script("return arguments[0].complete && arguments[0].naturalWidth", result) == 64
    assert "seed 7" in card.find_element(By.CLASS_NAME, "params").text
    assert card.find_element(By.CLASS_NAME, "download").get_attribute("download") == "mlxdiff-7.png"

    second = submit(page, "a large yellow diamond in the centre on a gray background", 1000, 8)
    WebDriverWait(page, 60).until(lambda b: second.get_attribute("data-status") == "progress")
    second.find_element(By.CLASS_NAME, "cancel").click()
    WebDriverWait(page, 30).until(lambda b: second.get_attribute("data-status") == "cancelled")
    assert int(second.get_attribute("data-last-step")) < 1000
    assert second.find_element(By.CLASS_NAME, "status").text == "cancelled"

    # FLUX.2 takes an image and a mask, and the server offers a LoRA: the page shows those inputs
    for shown in ("image-section", "mask-label", "loras-section"):
        assert page.find_element(By.ID, shown).is_displayed(), shown
    image, mask = tmp_path / "red.png", tmp_path / "mask.png"
    Image.new("RGB", (64, 64), (220, 30, 30)).save(image)
    holes = Image.new("RGB", (64, 64))
    holes.paste((255, 255, 255), (16, 16, 48, 48))           # white: repaint the centre
    holes.save(mask)
    page.find_element(By.ID, "image").send_keys(str(image))
    page.find_element(By.ID, "mask").send_keys(str(mask))
    lora = page.find_element(By.CSS_SELECTOR, "#loras .lora")
    assert "shapes-style" in lora.text
    lora.find_element(By.CLASS_NAME, "lora-use").click()
    scale = lora.find_element(By.CLASS_NAME, "lora-scale")
    scale.clear()
    scale.send_keys("0.8")
    third = submit(page, "a small blue circle in the centre on a white background", 2, 9)
    WebDriverWait(page, 60).until(lambda b: third.get_attribute("data-status") in ("done", "error"))
    assert third.get_attribute("data-status") == "done", third.find_element(By.CLASS_NAME, "error").text
    result = third.find_element(By.CLASS_NAME, "result")
    assert page.execute_script("return arguments[0].complete && arguments[0].naturalWidth", result) == 64
    params = third.find_element(By.CLASS_NAME, "params").text
    assert "from red.png, mask mask.png" in params and "LoRAs: shapes-style:0.8" in params
    status, job = call(page.base, f"/v1/jobs/{third.get_attribute('data-job-id')}")
    assert status == 200 and job["parameters"]["mask"] == "mask.png" and job["parameters"]["loras"] == \
        "shapes-style:0.8"
    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert page.save_screenshot(str(SCREENSHOT))


def text_only(names, images, strength):
    if images:
        raise MlxdiffError("image: this model generates from text alone; leave --image out")


def test_inputs_hidden_where_the_family_takes_none(page):
    """A pipeline of its own whose image check refuses every image and whose options have no mask (as Krea 2's and
    Qwen-Image 2.1's), served with no LoRAs: the page shows no image, mask or LoRA input."""
    pipe = mlxdiff.load(str(default_model.folder()))
    pipe.check_images = text_only
    pipe.OPTIONS = {k: v for k, v in type(pipe).OPTIONS.items() if k not in ("mask", "mask_blur", "outpaint")}
    with running_server(pipe) as (base, _):
        takes = call(base, "/v1/models")[1]["data"][0]["takes"]
        assert takes["image"] is False and takes["mask"] is False and takes["loras"] == []
        page.get(base + "/")
        WebDriverWait(page, 20).until(lambda b: "FLUX" in b.find_element(By.ID, "model").text)
        for hidden in ("image-section", "mask-label", "loras-section"):
            assert not page.find_element(By.ID, hidden).is_displayed(), hidden
        assert page.find_element(By.ID, "prompt").is_displayed()
